"""A run's checkpoint: everything a resumed run needs to continue identically.

    step, version        the next step, and the policy's model version
    model                the policy's weights (the adapter alone under LoRA; several policies:
                         {policy: its adapter's})
    engine               collect overlap: the engine's copy of the weights, with their version;
                         without next_collected, the weights the next step's rollouts come from
                         (the policy before the last update)
    next_collected       collect overlap: the next step's rollouts when their collect finished
                         before the checkpoint (the end of a step, or a signal's stop): a resumed
                         run trains them, it does not collect them again (the rollouts
                         themselves are in the store)
    optimizer, scheduler their state
    ref_model            the KL reference, when the loss has one
    whole, whole_refs    several policies: each whole-model policy's model and KL reference
    frozen               roles.serve "frozen": the copy of the policy that serves those roles
    rng, history         torch's and Python's random state at the end of the step; the metrics of
                         the steps so far
    precision            what trainer.precision "auto" chose, kept on resume
    collector            collect "continuous": the next group and the groups launched, not trained
    eval_pending         the last step's eval was stopped by a signal: the resumed run runs it

`state` is that dict, made of the run's state (run/state.py), the learner's and the engine's weights
(its tensors copied when it is written while the run goes on); `save` writes it whole or not at all
(run/durable.py); `restore` checks it, puts the weights back into a learner and a weight sync built
from the same config and returns the run's state. `Checkpoints` writes a run's into
run_dir/checkpoints/ on its own thread, one at a time, and finds the newest that verifies.

`save_weights` writes a weights-only checkpoint (`tracetrain sft`'s): kind "weights", the model
(the adapter alone under LoRA) and what made it. `tracetrain eval --policy` and `sft --policy` read
it like a run's; a run cannot resume from it (no optimizer, step or history): an RL run starts
from the policy/ folder beside it.
"""

from __future__ import annotations

import copy
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import TrainerConfig
from tracetrain.models import lora
from tracetrain.run import durable
from tracetrain.run.state import RunState

KEYS = ("step", "version", "model", "optimizer", "scheduler", "rng", "history")  # what every run's has


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from (the message names the file and why)."""


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never trains: every module in eval mode, no parameter requiring a
    gradient. The KL reference and the roles.serve "frozen" copy, of a fresh run and of a resumed
    one alike (a resumed run's then takes the checkpoint's weights)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def due(t: TrainerConfig, step: int, checkpointed: float) -> bool:
    """Whether a checkpoint is due after step `step` (the next step's number) under trainer
    config `t`: every `t.checkpoint_every` steps, or `t.checkpoint_minutes` after the last one
    (written at time.monotonic() `checkpointed`)."""
    return bool(t.checkpoint_every and step % t.checkpoint_every == 0
                or t.checkpoint_minutes and time.monotonic() - checkpointed >= 60 * t.checkpoint_minutes)


def rng_state() -> dict:
    """torch's and Python's random state now."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _copied(x: Any) -> Any:
    """`x` with every tensor in it cloned (dicts, lists and tuples followed)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copied(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(_copied(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_copied(v) for v in x)
    return x


def state(run: RunState, learner: Any, sync: Any, *, copied: bool = False) -> dict:
    """The checkpoint (module docstring) of a run at `run`, with `learner`'s weights and
    optimizers (run/learner.py) and `sync`'s engine weights (run/weights.py). `copied`: every
    tensor cloned and the history copied, so the run may go on while it is written."""
    out = {
        "step": run.step,
        "version": run.version,
        **learner.checkpoint(),
        "engine": sync.checkpoint(),
        "next_collected": run.next_collected,
        "rng": run.rng or rng_state(),
        "history": run.history,
        "precision": run.precision,
        "collector": run.collector,
        "eval_pending": run.eval_pending,
    }
    return {**_copied(out), "history": copy.deepcopy(run.history)} if copied else out


def save(path: Path, run: RunState, learner: Any, sync: Any) -> Path:
    """Write the checkpoint of `state(run, learner, sync)` to `path`, whole or not at all."""
    payload = state(run, learner, sync)
    return durable.write(path, lambda f: torch.save(payload, f))


class Checkpoints:
    """A run's checkpoints in run_dir/checkpoints/ (durable.py's layout), the last `keep` kept.
    `write` hands a state to one writer thread (the previous write finished first) and returns;
    `wait` blocks until it is on disk and raises what its write raised."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir, self.folder, self.keep = run_dir, run_dir / "checkpoints", keep
        self.pool: ThreadPoolExecutor | None = None
        self.pending: Future | None = None
        self.written: Path | None = None  # the newest whole checkpoint of this process

    def write(self, payload: dict, *, wait: bool) -> None:
        self.wait()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending = self.pool.submit(self._write, payload)
        if wait:
            self.wait()

    def _write(self, payload: dict) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob("*.tmp"):  # a write a crash cut short
            tmp.unlink(missing_ok=True)
        path = self.folder / f"step-{payload['step']:06d}.pt"
        try:
            durable.write(path, lambda f: torch.save(payload, f))
        except OSError as e:
            prev = durable.newest_valid(self.run_dir)[0]
            raise durable.CheckpointWriteError(
                e.errno, f"checkpoint {path}: {e.strerror or e}; "
                + (f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint")) from e
        durable.publish(self.run_dir, path, self.keep)
        self.written = path
        return path

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def write_policy(model: torch.nn.Module, tokenizer, path: Path,
                 whole: dict[str, torch.nn.Module] | None = None) -> Path:
    """`path` (a run's policy/): the policy as a Hugging Face directory (models/save.write_hf_dir);
    under LoRA the merged model, and the adapter alone in path/adapter (peft's format). With
    several policies: path/<policy>/ each, its own adapter merged, and the adapter alone in
    path/<policy>/adapter; a whole-model policy's (`whole`) its model."""
    from tracetrain.models.save import write_hf_dir

    for name, m in (whole or {}).items():
        write_hf_dir(m, tokenizer, path / name)
    if whole and not lora.adapter_names(model):  # every policy a whole model
        return path

    if names := lora.adapter_names(model):
        for name in names:
            write_hf_dir(lora.merged(model, name), tokenizer, path / name)
            model.save_pretrained(path / name / "adapter", selected_adapters=[name])
            for f in (path / name / "adapter" / name).iterdir():  # (peft puts a named one in a folder)
                f.replace(path / name / "adapter" / f.name)
            (path / name / "adapter" / name).rmdir()
        return path
    write_hf_dir(lora.merged(model), tokenizer, path)
    if lora.is_lora(model):
        model.save_pretrained(path / "adapter")
    return path


def save_weights(model: torch.nn.Module, path: Path, made_by: dict,
                 whole: dict[str, torch.nn.Module] | None = None) -> Path:
    """Write `model`'s weights (lora.weights) and the `whole` models' with `made_by` to `path`,
    atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save({"kind": "weights", "model": lora.weights(model), "made_by": made_by,
                "whole": {name: m.state_dict() for name, m in (whole or {}).items()}}, tmp)
    tmp.replace(path)
    return path


def load(path: Path) -> dict:
    """The run checkpoint at `path`, checked: loadable, and every key a run's has."""
    try:
        ck = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 (torch raises RuntimeError, pickle its own, zipfile its own)
        raise CheckpointError(f"{path}: not a loadable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"{path}: not a checkpoint (a {type(ck).__name__})")
    if ck.get("kind") == "weights":
        from tracetrain.config import ConfigError

        raise ConfigError(f"{path}: a weights-only checkpoint ({ck['made_by'].get('command', '?')}'s), "
                          "not a run's: start a run from the policy/ folder beside it "
                          "(model.kind=pretrained model.path=...)")
    if missing := [k for k in KEYS if k not in ck]:
        raise CheckpointError(f"{path}: not a run's checkpoint (no {', '.join(missing)})")
    return ck


def restore(path: Path, learner: Any, sync: Any) -> RunState:
    """The checkpoint at `path` put back: `learner`'s weights and optimizers, `sync`'s engine
    weights, the random state; returns the run's state."""
    ck = load(path)
    learner.restore(ck, path)
    sync.restore(ck.get("engine"))
    torch.set_rng_state(ck["rng"]["torch"])
    random.setstate(ck["rng"]["python"])
    return RunState(step=ck["step"], version=ck.get("version", ck["step"]), history=ck["history"],
                    next_collected=ck.get("next_collected"), collector=ck.get("collector"),
                    precision=ck.get("precision"), eval_pending=ck.get("eval_pending", False))


def resume(run_dir: Path, learner: Any, sync: Any, log=print) -> RunState | None:
    """The newest checkpoint of `run_dir` that verifies (durable.newest_valid), restored; those
    skipped and the one taken logged; None if none."""
    path, skipped = durable.newest_valid(run_dir)
    for why in skipped:
        log(f"checkpoint skipped: {why}")
    if path is None:
        return None
    run = restore(path, learner, sync)
    log(f"resumed from {path} at step {run.step}")
    return run
