"""Batches that do not depend on timing: a local engine's batch closes when every live agent is
waiting on a model call (`trainer.reproducible`). The runner counts the agents, the engines
count the calls (engines/local.py takes a Lockstep as `lockstep`).

A batch gathered by arrival (a quiet window) holds whichever requests came in time, so two runs
of one seed batch differently; a batch's shape changes the float results of the forward pass
(matmul blocking, padding), which changes a sampled token now and then, and the runs part. Under
lockstep the engines' collectors wait until

    waiting >= agents

`agents`: the agents that will call a model again before they end (the runner's count: of a call
of n rollouts with k at a time, min(unfinished, k), lowered as each agent returns; never lowered
early, so a batch never closes without a request that was on its way); `waiting`: the calls made
to the lockstep engines and not answered yet (counted by the engines, lowered when the answer is
set, before the caller runs again). The batch is then every pending call, in a fixed order
(local.py: by seed, then prompt ids). With deterministic agents each round's batch is the same set
of calls in the same order on every run: the same logits, the same sampled tokens (each call's
draw is seeded by its own seed, engines/sampling.py).

What it costs: an agent that is slow between two calls holds the others' next batch back. What
it does not cover: an agent that makes several calls at once (the count is of calls, not of
agents), agents on Ray, calls to engines outside the lockstep (an upstream server), and which
groups a continuous collection trains in a step (the trainer's clock decides that).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Lockstep:
    """The two counts and a change signal (module docstring). Every method is called from the
    event loop's thread (a worker process's news arrives through `loop.call_soon_threadsafe`)."""

    def __init__(self) -> None:
        self.agents = 0
        self._engines: list[Callable[[], int]] = []
        self._waiters: set[asyncio.Event] = set()  # one per waiting collector, of its own loop

    def watch(self, unanswered: Callable[[], int]) -> None:
        """Count an engine's calls not answered yet (a function of the engine's state)."""
        self._engines.append(unanswered)

    @property
    def waiting(self) -> int:
        return sum(f() for f in self._engines)

    def add_agents(self, n: int) -> None:
        """n more agents (negative: fewer) that will call before they end."""
        self.agents += n
        if self.agents < 0:
            raise RuntimeError(f"lockstep: {self.agents} agents (an agent counted out twice)")
        self.changed()

    def changed(self) -> None:
        """A count moved: the waiting collectors look again."""
        for event in self._waiters:
            event.set()

    def ready(self) -> bool:
        return self.waiting >= self.agents

    async def wait(self) -> None:
        """Return once every live agent is waiting on a call."""
        while not self.ready():
            event = asyncio.Event()
            self._waiters.add(event)
            try:
                await event.wait()
            finally:
                self._waiters.discard(event)


class AgentCount:
    """The runner's share of `Lockstep.agents` for one call of n rollouts run k at a time: the
    agents that will still call, min(unfinished, k), kept in the lockstep as rollouts end."""

    def __init__(self, lockstep: Lockstep | None, n: int, k: int) -> None:
        self.lockstep, self.unfinished, self.k = lockstep, n, k
        if lockstep is not None:
            lockstep.add_agents(min(n, k))

    def ended(self) -> None:
        """One agent returned (it calls no more); after `close`, nothing (a worker's news of an
        agent can arrive after its call ended)."""
        if self.unfinished <= 0:
            return
        before = min(self.unfinished, self.k)
        self.unfinished -= 1
        if self.lockstep is not None:
            self.lockstep.add_agents(min(self.unfinished, self.k) - before)

    def close(self) -> None:
        """Whatever did not end (the call was cancelled) stops counting."""
        if self.lockstep is not None and self.unfinished:
            self.lockstep.add_agents(-min(self.unfinished, self.k))
        self.unfinished = 0
