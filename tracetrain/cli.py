"""Command line: `tracetrain <command>` (also `python -m tracetrain <command>`).

Commands are registered by name in COMMANDS: (add_arguments, run, help); `run(args) -> int` returns
the exit status. What the user gave wrong (types.UsageError, config.ConfigError among them: a
config key, a dataset file or row, a task file, a trace file, an option, a path) is reported in
one line naming it, status 2; an engine that failed mid-run, or a run whose rollouts all failed
(types.RunFailed: the step and the first error), in one line, status 1; any other error is a bug
or the machine's (a full disk) and keeps its traceback.

    train   : run the main job from a YAML config (+ key=value overrides)
    inspect : one rollout of a run down the path of the data
    serve   : the gateway on its own (see `tracetrain serve --help`)
    view    : a web page over a run directory: curves, steps, rollouts down to the token
    eval    : a policy (policy/ folder, checkpoint, or untrained) on the run's eval tasks, pass@k
    sft     : fine-tune on the exact tokens of the best rollouts of earlier runs -> a policy/ folder
    rows    : build rows from example traces and print rows, metrics and drift breaks
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from tracetrain.engines.base import EngineError
from tracetrain.types import RunFailed, UsageError
from tracetrain.view.trace_rows import add_demo_arguments, run_demo


def whole(low: int, high: int | None = None):
    """argparse type: an int in [low, high] (argparse names the option when it is not)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value"
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def number(low: float | None = None, *, above: bool = False):
    """argparse type: a finite float, >= low (> low with `above`) when low is given."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low:g}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def override(text: str) -> str:
    """argparse type: a config override `key=value` (config.parse_overrides reads it)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value (a config override), got {text!r}")
    return text


def add_overrides(p: argparse.ArgumentParser, example: str = "") -> None:
    """The command's config overrides: `key=value` words, before, between or after its options."""
    p.add_argument("overrides", nargs="*", type=override, default=[], metavar="key=value",
                   help="config overrides, anywhere among the options" + example)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config (YAML)")
    p.add_argument("--backend", choices=["embedded", "verl"], default=None,
                   help="override the config's backend (verl: docs/scaling.md)")
    add_overrides(p, " (e.g. optim.lr=3e-4 trainer.steps=50)")


def terminate(signum, frame) -> None:
    """SIGTERM on the verl backend: stop the vLLM servers this run launched (their own session:
    the signal does not reach them), then end at once, as SIGTERM's default would. (The embedded
    trainer stops at its next stop point and checkpoints: run/stop.py.)"""
    from tracetrain.engines.vllm_server import stop_launched

    stop_launched()
    os._exit(128 + signum)


def before_the_loop(signum, frame) -> None:
    """SIGTERM before the trainer's loop takes the signals (run/stop.py): nothing of the run is
    done in this process yet, so it ends at once, exit 0. Not by raising SystemExit: a handler
    runs wherever the main thread is, and an exception raised inside a weakref callback or a
    __del__ (the import system runs such callbacks) is printed and dropped, and the run went on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_train(args: argparse.Namespace) -> int:
    from tracetrain.config import load_config
    from tracetrain.run.trainer import train

    overrides = list(args.overrides) + ([f"backend={args.backend}"] if args.backend else [])
    signal.signal(signal.SIGTERM, before_the_loop)
    cfg = load_config(args.config, overrides)
    if cfg.backend == "verl":  # verl's PPO workers on Ray train; the gateway and runner collect
        signal.signal(signal.SIGTERM, terminate)
        from tracetrain.integrations.verl.trainer import train_verl

        train_verl(cfg, base_dir=args.config.resolve().parent)
        return 0
    train(cfg, base_dir=args.config.resolve().parent)
    # the run is written and its services stopped: a SIGTERM has nothing left to stop (and, once
    # the interpreter finalizes, Python's handlers are gone: it would end the process with -15)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN", help="a run directory (or its traces.db)")
    p.add_argument("--rollout", default=None, help="rollout id (default: the last finished one)")


def run_inspect(args: argparse.Namespace) -> int:
    from tracetrain.view.inspection import inspect_rollout

    inspect_rollout(args.run_dir, args.rollout)
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="the run's config (YAML): model, task, data, agent")
    p.add_argument("--policy", default=None,
                   help="a policy/ folder, a checkpoint.pt or a Hugging Face model id "
                   "(default: the config's model, untrained)")
    p.add_argument("--k", type=whole(1), default=4, help="tries per task (pass@1 and pass@k); default 4")
    p.add_argument("--temperature", type=number(0), default=1.0, help="sampling temperature; default 1")
    p.add_argument("--tasks", type=whole(1), default=None, help="eval tasks (default trainer.eval_tasks)")
    p.add_argument("--success", type=number(), default=1.0,
                   help="a try succeeds when its reward is >= this (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write one JSON line per task here")
    add_overrides(p)


def run_eval(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from tracetrain.agents.tasks import open_task_data
    from tracetrain.config import load_config
    from tracetrain.envs import load_source
    from tracetrain.run.evaluate import evaluate

    cfg = load_config(args.config, list(args.overrides))
    if args.out is not None:
        writable_dir("--out", args.out.parent)
        if args.out.is_dir():
            raise UsageError(f"--out {str(args.out)!r} is a folder; it names the file to write")
    base = args.config.resolve().parent
    task = load_source(cfg, base)
    try:
        summary, rows = asyncio.run(evaluate(
            cfg, task, open_task_data(cfg, base, task), policy=policy_arg(args.policy), k=args.k,
            temperature=args.temperature, n_tasks=args.tasks, success=args.success))
    finally:
        if cfg.env is not None:  # what the environment opened in this process (a server)
            task.close()
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(summary))
    return 0


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="the run's config (YAML or a run's config.json)")
    p.add_argument("--from", dest="runs", type=Path, nargs="+", action="extend", required=True,
                   metavar="RUN_DIR", help="runs whose traces.db hold the rollouts to learn from "
                   "(the list ends at the next option or key=value)")
    p.add_argument("--min-reward", type=number(), default=None, help="rollouts with at least this reward")
    p.add_argument("--best-per-group", type=whole(1), default=None, help="the k best rollouts of each group")
    p.add_argument("--max-version", type=whole(0), default=None,
                   help="only rollouts made by policies up to this version (0: the untrained one's)")
    p.add_argument("--policy", default=None, help="start from this policy/ folder, checkpoint or "
                   "Hugging Face model id (default: the config's model)")
    p.add_argument("--epochs", type=whole(1), default=3)
    p.add_argument("--lr", type=number(0, above=True), default=1e-5)
    p.add_argument("--out", type=Path, required=True,
                   help="writes OUT/policy, OUT/checkpoint.pt (weights only) and OUT/sft.json")
    add_overrides(p)


def run_sft(args: argparse.Namespace) -> int:
    import json

    from tracetrain.config import load_config
    from tracetrain.learn.sft import dedupe, select
    from tracetrain.models.compute import on_compute
    from tracetrain.store import SQLiteStore

    if args.min_reward is None and args.best_per_group is None:
        raise UsageError("choose the rollouts to learn from: --min-reward and/or --best-per-group")
    cfg = load_config(args.config, list(args.overrides))
    writable_dir("--out", args.out)
    args.policy = policy_arg(args.policy)
    seen, chosen = 0, []
    for run in args.runs:
        if not (run / "traces.db").is_file():
            raise UsageError(f"--from {str(run)!r}: no traces.db there")
        with SQLiteStore(run / "traces.db", read_only=True) as store:
            rollouts = store.load_rollouts()
        seen += len(rollouts)
        chosen += select(rollouts, min_reward=args.min_reward, best_per_group=args.best_per_group,
                         max_version=args.max_version)
    unique = dedupe(chosen)
    if not unique:
        raise UsageError(f"no rollout of {seen} in {[str(r) for r in args.runs]} was chosen")
    # the model loaded and trained on the compute thread, as `train` does (models/compute.py)
    report = on_compute(0, fine_tune_chosen, cfg, args, unique, {
        "runs": [str(r) for r in args.runs], "rollouts_seen": seen, "chosen": len(chosen)})
    (args.out / "sft.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


def policy_arg(value: str | None) -> str | None:
    """--policy: a path as given (a policy/ folder, a checkpoint; one that is not there is
    refused where it is loaded); a Hugging Face model id: its snapshot directory (models/hub.py)."""
    from tracetrain.models.hub import is_repo_id, resolve_model_dir

    if value is None or Path(value).exists() or not is_repo_id(value):
        return value
    return resolve_model_dir(value, None, "--policy")


def fine_tune_chosen(cfg, args: argparse.Namespace, unique: list, report: dict) -> dict:
    """`tracetrain sft`'s model work: the policy loaded, fine-tuned on the `unique` rollouts'
    trained tokens (each policy on its own roles'), written to OUT/policy and OUT/checkpoint.pt;
    `report` with what was trained added."""
    from tracetrain.learn.sft import fine_tune, sft_rows
    from tracetrain.run import checkpoint
    from tracetrain.run.evaluate import load_eval_policy, load_eval_whole

    model, tokenizer = load_eval_policy(cfg, args.policy, adapter=True)
    whole = load_eval_whole(cfg, args.policy, sft=True)  # whole-model policies: their own models
    # several policies: each adapter on its own roles' tokens (the config as that policy learns)
    parts = {n: cfg.for_policy(n) for n in cfg.policies} if cfg.policies else {None: cfg}
    rows, tokens, losses = 0, 0, {}
    for name, part in parts.items():
        try:
            batch = sft_rows(unique, part, tokenizer.pad_token_id or 0)
        except UsageError:
            if len(parts) == 1:
                raise
            continue  # (this policy's roles have no tokens in the chosen rollouts)
        if name is not None and name not in whole:
            model.set_adapter(name)  # its parameters alone train
        losses[name] = fine_tune(whole.get(name, model), batch, part, epochs=args.epochs, lr=args.lr,
                                 seed=cfg.trainer.seed)
        rows, tokens = rows + batch.n_rows, tokens + int(batch.response_mask.sum())
    if not losses:
        raise UsageError("no rows to fine-tune on for any policy (policies.*.roles)")
    path = checkpoint.write_policy(model, tokenizer, args.out / "policy", whole)  # as a run's policy/
    report = {**report, "trained_rollouts": len(unique), "rows": rows, "trained_tokens": tokens,
              "epoch_losses": losses[None] if None in losses else losses,
              "policy": str(path), "checkpoint": str(args.out / "checkpoint.pt")}
    checkpoint.save_weights(model, args.out / "checkpoint.pt", {"command": "tracetrain sft", **report}, whole)
    return report


def writable_dir(option: str, path: Path) -> None:
    """The folder `path` an option writes into, made now (before any work); a UsageError naming
    the option if it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{option}: cannot write into {str(path)!r} ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{option}: cannot write into {str(path)!r} (permission denied)")


def add_view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory")
    p.add_argument("--port", type=whole(0, 65535), default=8765, help="port (0: a free one); default 8765")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other host needs a token)")
    p.add_argument("--token", default=None,
                   help="a token every request must carry (made for a non-loopback host)")


def run_view(args: argparse.Namespace) -> int:
    from tracetrain.view.serve import serve_view

    serve_view(args.run_dir, host=args.host, port=args.port, token=args.token)
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="options of the gateway (--help)")


def run_serve(args: argparse.Namespace) -> int:
    from tracetrain.gateway.serve import main as serve_main

    return serve_main(args.serve_args) or 0


COMMANDS = {
    "train": (add_train_arguments, run_train, "train an agent from a YAML config"),
    "inspect": (add_inspect_arguments, run_inspect,
                "show one rollout: turns, rows, breaks, advantage, loss mass"),
    "eval": (add_eval_arguments, run_eval, "a policy on the run's eval tasks: reward, pass@1, pass@k"),
    "sft": (add_sft_arguments, run_sft, "fine-tune on the exact tokens of chosen rollouts of earlier runs"),
    "view": (add_view_arguments, run_view, "a web page over a run: curves, steps, rollouts to the token"),
    "serve": (add_serve_arguments, run_serve, "run the gateway (OpenAI-compatible, records token ids)"),
    "rows": (add_demo_arguments, run_demo, "build rows from example traces and print rows and metrics"),
}


def build_parser() -> argparse.ArgumentParser:
    """`tracetrain`'s parser: the commands (its help lists them; parse_args uses it when argv does
    not start with a command)."""
    parser = argparse.ArgumentParser(prog="tracetrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=name != "serve")
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `tracetrain NAME`."""
    add_arguments, run, help_text = COMMANDS[name]
    p = argparse.ArgumentParser(prog=f"tracetrain {name}", description=help_text,
                                add_help=name != "serve")
    add_arguments(p)
    p.set_defaults(run=run, command=name)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command and its arguments. A command's options and its words (the config, key=value
    overrides) come in any order (argparse's intermixed parsing); a list-valued option
    (`sft --from A B`) takes the words up to the next option or key=value."""
    if not argv or argv[0] not in COMMANDS or argv[0] == "serve":
        return build_parser().parse_args(argv)  # --help, no or an unknown command: it says so
    parser = command_parser(argv[0])
    return parser.parse_intermixed_args(_end_lists(parser, argv[1:]))


def _looks_like_override(word: str) -> bool:
    key, sep, _ = word.partition("=")
    return bool(sep and key.strip()) and "/" not in key and os.sep not in key


def _end_lists(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """`words` with each value of a list-valued option written `--opt=value`, the list ending at
    the first key=value after a value: `--from a b k=v` -> `--from=a --from=b k=v` (the option
    accumulates its values: action "extend")."""
    lists = {o for a in parser._actions if a.nargs in ("+", "*") for o in a.option_strings}
    out, k = [], 0
    while k < len(words):
        word = words[k]
        k += 1
        if word == "--":
            return out + words[k - 1:]
        if word not in lists:
            out.append(word)
            continue
        start = k
        while k < len(words) and not words[k].startswith("-") and (
                k == start or not _looks_like_override(words[k])):
            out.append(f"{word}={words[k]}")
            k += 1
        if k == start:
            out.append(word)  # no value: argparse says what the option needs
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the gateway parses its own options (and its own --help)
        from tracetrain.gateway.serve import main as serve_main

        return serve_main(argv[1:]) or 0
    args = parse_args(argv)
    try:
        return args.run(args)
    except UsageError as e:  # what the user gave wrong: say what, no traceback
        print(f"tracetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (EngineError, RunFailed) as e:  # the engine failed mid-run (a vLLM server that died), or
        # every rollout did (run/failures.py): what and why
        print(f"tracetrain {args.command}: error: {e}", file=sys.stderr)
        return 1
