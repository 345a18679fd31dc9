"""A command's options and its key=value overrides come in any order: before the options, after
them, or split around them; a word that is not key=value is refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracetrain.cli import COMMANDS, command_parser, main, parse_args

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "guess"
A, B = "engine.kind=vllm", "engine.python=.venv-vllm/bin/python"

# command -> (its config and required options, an option with its value, what that sets)
TAKES_OVERRIDES = {
    "train": (["c.yaml"], ["--backend", "verl"], ("backend", "verl")),
    "eval": (["c.yaml", "--policy", "P"], ["--k", "2"], ("k", 2)),
    "sft": (["c.yaml", "--from", "r", "--out", "o"], ["--lr", "3e-2"], ("lr", 3e-2)),
}


def test_every_command_that_takes_overrides_is_covered():
    takes = {name for name in COMMANDS
             if any(a.dest == "overrides" for a in command_parser(name)._actions)}
    assert takes == set(TAKES_OVERRIDES)


@pytest.mark.parametrize("command", sorted(TAKES_OVERRIDES))
@pytest.mark.parametrize("order", ["after", "before", "split", "first"])
def test_overrides_go_anywhere_among_the_options(command, order):
    base, option, (dest, value) = TAKES_OVERRIDES[command]
    argv = {
        "after": [*base, *option, A, B],
        "before": [*base, A, B, *option],
        "split": [*base, A, *option, B],
        "first": [base[0], A, *base[1:], B, *option],
    }[order]
    args = parse_args([command, *argv])
    assert args.command == command and args.config == Path("c.yaml")
    assert args.overrides == [A, B]  # in the order given: a later one wins
    assert getattr(args, dest) == value


def test_the_issues_eval_command_line_parses():
    args = parse_args(["eval", "examples/guess/dataset.yaml", "--policy", "P", "--k", "2", A, B])
    assert (args.policy, args.k, args.overrides) == ("P", 2, [A, B])


def test_sft_from_takes_runs_up_to_an_option_or_an_override():
    args = parse_args(["sft", "c.yaml", "--from", "r1", "r2", A, "--out", "o", B,
                       "--best-per-group", "1"])
    assert args.runs == [Path("r1"), Path("r2")] and args.overrides == [A, B]
    args = parse_args(["sft", "c.yaml", "--from", "r1", "--out", "o", "--from", "runs/x=1", A])
    assert args.runs == [Path("r1"), Path("runs/x=1")] and args.overrides == [A]  # a path, not a key
    assert parse_args(["sft", "c.yaml", "--out", "o", "--from", "r1", "r2"]).overrides == []


@pytest.mark.parametrize("argv, says", [
    (["eval", "c.yaml", "--k", "2", "stray"], "expected key=value (a config override), got 'stray'"),
    (["train", "c.yaml", A, "stray", "--backend", "verl"], "got 'stray'"),
    (["sft", "c.yaml", "--from", "r", "--out", "o", "=1"], "got '=1'"),
    (["eval", "--k", "2"], "the following arguments are required: config"),
])
def test_a_word_that_is_not_an_override_is_refused_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"tracetrain {argv[0]}: error: " in err and says in err


def test_main_applies_overrides_given_after_the_options(tmp_path, capsys):
    """The overrides after --k reach the config: the bad key among them is what is refused."""
    assert main(["eval", str(EXAMPLE / "config.yaml"), "--k", "2", "trainer.seed=1",
                 "optim.lrr=1"]) == 2
    assert "config key 'optim.lrr'" in capsys.readouterr().err
