"""`tracetrain <command>`: what the user gave wrong is one line with status 2 naming it; any other
error (a bug, a full disk) reaches the user with its traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracetrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "guess"
# The demo at its smallest: no warm start, one step of 2 rollouts, everything in this process.
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=0", "rollout.tasks_per_step=1", "rollout.n_per_task=2",
        "rollout.agent_workers=0", "trainer.steps=1", "trainer.collect=step",
        "trainer.eval_every=0", "trainer.precision=fp32"]


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tracetrain {command}: error: "), err
    assert "Traceback" not in err
    return err


# A deep failure, planted in the train process: torch's optimizer step raising a ValueError, or
# the checkpoint write failing for a full disk.
DEEP_FAILURES = {
    "ValueError": ("import torch\n"
                   "def step(self, *a, **k):\n"
                   "    raise ValueError('planted: a tensor torch refuses')\n"
                   "torch.optim.AdamW.step = step\n",
                   "ValueError: planted: a tensor torch refuses"),
    "OSError": ("import errno, torch\n"
                "def save(*a, **k):\n"
                "    raise OSError(errno.ENOSPC, 'No space left on device (planted)')\n"
                "torch.save = save\n",
                "OSError: [Errno 28] No space left on device (planted)"),
}


@pytest.mark.parametrize("kind", sorted(DEEP_FAILURES))
def test_an_error_deep_in_training_keeps_its_traceback(tmp_path, kind):
    plant, last_line = DEEP_FAILURES[kind]
    argv = ["train", str(EXAMPLE / "config.yaml"), *TINY, f"trainer.run_dir={tmp_path / 'run'}"]
    script = plant + textwrap.dedent(f"""
        import sys
        from tracetrain.cli import main
        sys.exit(main({argv!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode not in (0, 2), proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert last_line in proc.stderr.splitlines()  # the exception, as Python shows it
    assert "tracetrain train: error" not in proc.stderr


def test_a_bad_config_key_is_one_line(tmp_path, capsys):
    assert main(["train", str(EXAMPLE / "config.yaml"), "optim.lrr=1",
                 f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    assert "config key 'optim.lrr'" in one_line_error(capsys, "train")
    assert not (tmp_path / "run").exists()


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in one_line_error(capsys, "eval")


def test_a_missing_dataset_file_is_one_line(tmp_path, capsys):
    assert main(["train", str(EXAMPLE / "dataset.yaml"), *TINY, "data.train=no-such-games.jsonl",
                 f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = one_line_error(capsys, "train")
    assert "'data.train'" in err and "no-such-games.jsonl" in err


def test_a_bad_dataset_row_is_one_line_naming_file_and_row(tmp_path, capsys):
    games = tmp_path / "games.jsonl"
    games.write_text(json.dumps({"target": 1, "high": 4, "max_turns": 3}) + "\n{not json\n")
    assert main(["train", str(EXAMPLE / "dataset.yaml"), *TINY, f"data.train={games}",
                 f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = one_line_error(capsys, "train")
    assert str(games) in err and "line 2" in err


def test_sft_without_a_choice_of_rollouts_is_one_line(tmp_path, capsys):
    assert main(["sft", str(EXAMPLE / "config.yaml"), "--from", str(tmp_path),
                 "--out", str(tmp_path / "out")]) == 2
    assert "--min-reward and/or --best-per-group" in one_line_error(capsys, "sft")
    assert main(["sft", str(EXAMPLE / "config.yaml"), "--from", str(tmp_path),
                 "--best-per-group", "1", "--out", str(tmp_path / "out")]) == 2
    assert f"--from {str(tmp_path)!r}: no traces.db there" in one_line_error(capsys, "sft")


def test_an_eval_out_that_is_a_folder_is_one_line_before_any_work(tmp_path, capsys):
    assert main(["eval", str(EXAMPLE / "config.yaml"), "--out", str(tmp_path)]) == 2
    assert "--out" in one_line_error(capsys, "eval")


@pytest.mark.parametrize("argv, says", [
    (["eval", "c.yaml", "--k", "0"], "argument --k: must be >= 1, got 0"),
    (["eval", "c.yaml", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["eval", "c.yaml", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["eval", "c.yaml", "--tasks", "two"], "argument --tasks: invalid int value: 'two'"),
    (["sft", "c.yaml", "--from", "r", "--out", "o", "--lr", "0"], "argument --lr: must be > 0"),
    (["view", "r", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
])
def test_a_bad_option_value_is_refused_naming_the_option(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
