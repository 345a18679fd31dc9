"""`trainer.precision: auto`: the run trains in the precision a measured pass finds faster."""

from __future__ import annotations

from typing import Any

from tracetrain.config import TrainConfig
from tracetrain.learn.distributed import from_main
from tracetrain.learn.logprobs import faster_precision


async def resolve_precision(tr: Any) -> TrainConfig:
    """Trainer `tr`'s config with trainer.precision "auto" resolved: the checkpoint's choice when
    resuming, else rank 0's measurement (logprobs.faster_precision, on the update's threads), the
    same on every rank."""
    chosen = tr.resumed_precision
    if chosen is None and tr.dp.is_main:
        chosen, seconds = await tr.on_update_thread(tr.update_threads, faster_precision, tr.model)
        tr.log("trainer.precision auto: " + chosen + " (a training pass of the model: "
               + ", ".join(f"{p} {s:.3f} s" for p, s in seconds.items()) + ")")
    if tr.dp.enabled:
        chosen = await tr.on_update_thread(0, from_main, chosen, tr.dp)
    trainer = tr.cfg.trainer.model_copy(update={"precision": chosen})
    return tr.cfg.model_copy(update={"trainer": trainer})
