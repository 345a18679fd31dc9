"""A run's checkpoint: everything a resumed run needs to continue identically.

    step, version        the next step, and the policy's model version
    model                the policy's weights (the adapter alone under LoRA)
    engine               collect overlap: the weights the next step's rollouts come from (the
                         engine's: the policy before the last update), with their version
    next_collected       collect overlap: that collect's results when it already ran (the
                         rollouts themselves are in the store)
    optimizer, scheduler their state
    ref_model            the KL reference, when the loss has one
    frozen               roles.serve "frozen": the copy of the policy that serves those roles
    rng, history         torch's and Python's random state; the metrics of the steps so far
    precision            what trainer.precision "auto" chose, kept on resume
    collector            collect "continuous": the next group and the groups launched, not trained

`save` writes it atomically (a crash leaves the previous checkpoint whole); `restore` puts it back
into a Trainer built from the same config.

`save_weights` writes a weights-only checkpoint (`tracetrain sft`'s): kind "weights", the model
(the adapter alone under LoRA) and what made it. `tracetrain eval --policy` and `sft --policy` read
it like a run's; a run cannot resume from it (no optimizer, step or history): an RL run starts
from the policy/ folder beside it.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import torch

from tracetrain.models import lora


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never trains: every module in eval mode, no parameter requiring a
    gradient. The KL reference and the roles.serve "frozen" copy, of a fresh run and of a resumed
    one alike (a resumed run's then takes the checkpoint's weights)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def save(tr: Any, path: Path, next_collected: Any = None) -> Path:
    """Write trainer `tr`'s checkpoint to `path` (through a temporary file and a rename)."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": tr.step,
            "version": tr.version,
            "model": lora.weights(tr.model),
            "engine": None if tr.sync.engine_model is None else tr.sync.next_weights or {
                "model": lora.weights(tr.sync.engine_model), "version": tr.sync.engine_version},
            "next_collected": next_collected,
            "optimizer": tr.optimizer.state_dict(),
            "scheduler": tr.scheduler.state_dict(),
            "ref_model": None if tr.ref_model is None else tr.ref_model.state_dict(),
            "frozen": None if tr.frozen_model is None else lora.weights(tr.frozen_model),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "history": tr.history,
            "precision": tr.cfg.trainer.precision,
            "collector": tr.collector.state() if tr.collector is not None else tr.collector_state,
        },
        tmp,
    )
    tmp.replace(path)
    return path


def write_policy(model: torch.nn.Module, tokenizer, path: Path) -> Path:
    """`path` (a run's policy/): the policy as a Hugging Face directory (engines/vllm.write_hf_dir);
    under LoRA the merged model, and the adapter alone in path/adapter (peft's format)."""
    from tracetrain.engines.vllm import write_hf_dir

    write_hf_dir(lora.merged(model), tokenizer, path)
    if lora.is_lora(model):
        model.save_pretrained(path / "adapter")
    return path


def save_weights(model: torch.nn.Module, path: Path, made_by: dict) -> Path:
    """Write `model`'s weights (lora.weights) with `made_by` to `path`, atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save({"kind": "weights", "model": lora.weights(model), "made_by": made_by}, tmp)
    tmp.replace(path)
    return path


def restore(tr: Any, path: Path) -> None:
    """Load the checkpoint at `path` into trainer `tr`."""
    ck = torch.load(path, weights_only=False)
    if ck.get("kind") == "weights":
        from tracetrain.config import ConfigError

        raise ConfigError(f"{path}: a weights-only checkpoint ({ck['made_by'].get('command', '?')}'s), "
                          "not a run's: start a run from the policy/ folder beside it "
                          "(model.kind=pretrained model.path=...)")
    lora.load_weights(tr.model, ck["model"])
    tr.optimizer.load_state_dict(ck["optimizer"])
    tr.scheduler.load_state_dict(ck["scheduler"])
    if ck["ref_model"] is not None:
        tr.ref_model = frozen_copy(tr.model)
        tr.ref_model.load_state_dict(ck["ref_model"])
    if ck.get("frozen") is not None:
        tr.frozen_model = frozen_copy(tr.model)
        lora.load_weights(tr.frozen_model, ck["frozen"])
    torch.set_rng_state(ck["rng"]["torch"])
    random.setstate(ck["rng"]["python"])
    tr.step = ck["step"]
    tr.version = ck.get("version", ck["step"])
    tr.history = ck["history"]
    if ck.get("engine") is not None:
        tr.sync.engine_model = copy.deepcopy(tr.model)
        lora.load_weights(tr.sync.engine_model, ck["engine"]["model"])
        tr.sync.engine_version = ck["engine"]["version"]
    tr.next_collected = ck.get("next_collected")
    tr.resumed_precision = ck.get("precision")
    tr.collector_state = ck.get("collector")
