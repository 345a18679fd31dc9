"""`trainer.precision: auto`: the run trains in the precision a measured pass finds faster."""

from __future__ import annotations

from tracetrain.config import TrainConfig
from tracetrain.learn.distributed import DataParallel, from_main
from tracetrain.learn.logprobs import faster_precision


async def resolve_precision(cfg: TrainConfig, model, *, resumed: str | None, dp: DataParallel,
                            update_thread, log=print) -> TrainConfig:
    """`cfg` with trainer.precision "auto" resolved: `resumed` (the checkpoint's choice) when
    resuming, else rank 0's measurement of `model` (logprobs.faster_precision, on the update's
    thread: run/update_thread.py), the same on every rank."""
    chosen = resumed
    if chosen is None and dp.is_main:
        chosen, seconds = await update_thread.run(update_thread.update_threads, faster_precision,
                                                  model)
        log("trainer.precision auto: " + chosen + " (a training pass of the model: "
            + ", ".join(f"{p} {s:.3f} s" for p, s in seconds.items()) + ")")
    if dp.enabled:
        chosen = await update_thread.run(0, from_main, chosen, dp)
    trainer = cfg.trainer.model_copy(update={"precision": chosen})
    return cfg.model_copy(update={"trainer": trainer})
