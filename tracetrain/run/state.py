"""Where a run is: what the loop moves forward each step and a checkpoint keeps beside the
weights (run/checkpoint.py); a resumed run's is its checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """The run's progress, owned by the loop (run/trainer.py) and handed to whoever needs it.

    step            the next step to run (the number of steps done)
    version         the policy's model version: one bump per update
    history         the metrics of the steps so far, one dict a step
    rng             torch's and Python's random state at the end of the last step (None before it)
    next_collected  step `step`'s rollouts when they were collected before the checkpoint
                    (collect overlap): a resumed run trains them, it does not collect them again
    collector       collect continuous: the next group and the groups launched, not trained
    precision       what trainer.precision is (what "auto" chose, kept on resume)
    eval_pending    a signal stopped the last step's eval: a resumed run runs it
    """

    step: int = 0
    version: int = 0
    history: list[dict] = field(default_factory=list)
    rng: dict | None = None
    next_collected: Any = None  # run/step.Collected
    collector: dict | None = None
    precision: str | None = None
    eval_pending: bool = False
