"""Fail fast: a run whose rollouts all fail stops, and says why (trainer.max_failed_steps).

    failed step   a step that took rollouts and none of them succeeded: each failed (the agent
                  raised, the engine refused its calls, its worker died) or timed out
    stop          after trainer.max_failed_steps failed steps in a row (0: never), before the
                  last of them trains: its step line, then types.RunFailed naming the steps and
                  the first failed rollout's error (`first_error`); the run keeps the checkpoint
                  of its last completed step, summary.json's `stopped` says why and
                  `tracetrain train` exits 1
    goes on       a step with at least one succeeded rollout ends the streak

Shared by the embedded trainer (run/trainer.py) and the verl loop (integrations/verl/trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ERROR_CHARS = 500  # the most of a rollout's error line a stop message carries
NO_ERROR = "(no error recorded)"


def error_line(error: str | None, limit: int = ERROR_CHARS) -> str:
    """The line of a rollout's error that names the cause: a traceback's last non-blank line (the
    exception raised and its message; an engine's refusal reaches it as the agent's HTTP client's
    error, with the engine's message), cut to `limit` characters; NO_ERROR for none."""
    lines = [x.strip() for x in (error or "").splitlines() if x.strip()]
    if not lines:
        return NO_ERROR
    line = lines[-1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def first_error(results: Sequence[Any]) -> str:
    """The error line of the first rollout of `results` (each with state and error) that failed,
    else of the first that timed out; NO_ERROR when none did."""
    for state in ("failed", "timed_out"):
        for r in results:
            if r.state == state:
                return error_line(r.error)
    return NO_ERROR


def counts(results: Sequence[Any]) -> str:
    """How the rollouts of a failed step ended: "4 failed", "3 failed, 1 timed out"."""
    states = [r.state for r in results]
    parts = [f"{states.count(s)} {s.replace('_', ' ')}" for s in ("failed", "timed_out") if s in states]
    return ", ".join(parts)


class FailedSteps:
    """The failed steps in a row of one run (module docstring); `see` each step's rollouts."""

    def __init__(self, limit: int):
        self.limit = limit  # trainer.max_failed_steps; 0: the run never stops for it
        self.streak: list[int] = []  # the failed steps in a row, up to the last seen
        self.error = NO_ERROR  # the first error of the streak's first step
        self.stop_counts: dict[str, int] = {}  # the stopping step's rollouts by state (in no history)

    def see(self, step: int, results: Sequence[Any]) -> str | None:
        """Step `step`'s rollouts: the reason the run stops, when it is the `limit`-th failed step
        in a row; else None. A step with no rollouts (continuous collection's last take) counts
        neither way."""
        if not results:
            return None
        if any(r.state == "succeeded" for r in results):
            self.streak, self.error = [], NO_ERROR
            return None
        if not self.streak:
            self.error = first_error(results)
        self.streak.append(step)
        if not self.limit or len(self.streak) < self.limit:
            return None
        self.stop_counts = {s: sum(r.state == s for r in results) for s in ("failed", "timed_out")}
        if len(self.streak) == 1:
            return f"every rollout of step {step} failed ({counts(results)}): {self.error}"
        return (f"every rollout of steps {self.streak[0]}..{step} failed ({len(self.streak)} steps "
                f"in a row, trainer.max_failed_steps {self.limit}); the first error: {self.error}")


def failed_step_line(step: int, results: Sequence[Any], reason: str) -> str:
    """The step line of the step that stopped the run (run/rundir.py's format_step for the
    others)."""
    states = [r.state for r in results]
    return (f"step {step:4d} | fail {states.count('failed')}+{states.count('timed_out')} "
            f"| stopped: {reason}")
