"""Seconds of each phase of an update (the step's metrics time/update/<phase>_s).

    pack       packing the rows into one sequence per micro-batch (packing.pack_rows)
    old        the policy's logprobs before the step's first optimizer step (the proximal pass;
               0 when the engine's recorded logprobs are the old ones)
    forward    the policy's forward passes with grad (logits, logprobs, entropy)
    reference  the frozen reference model's passes (KL on)
    loss       policy_loss over the micro-batches' logprobs
    backward   loss.backward()
    optimizer  clip grad norm, AdamW step, lr schedule

On a CPU every torch op returns when its work is done, so a wall clock around a phase is its time.
`Phases` sums a phase's seconds over the update; `on_end(name)`, when given, is called as each
phase ends (bench/bench_floor.py reads the resident peak there).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

PHASES = ("pack", "old", "forward", "reference", "loss", "backward", "optimizer")


class Phases:
    """Seconds per phase (PHASES), summed over the calls of `phase`."""

    def __init__(self, on_end: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_end = on_end

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase {name!r}: one of {PHASES}")
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            if self.on_end is not None:
                self.on_end(name)

    def metrics(self) -> dict[str, float]:
        """{time/update/<phase>_s}: every phase, 0 where it did not run."""
        return {f"time/update/{p}_s": self.seconds.get(p, 0.0) for p in PHASES}
