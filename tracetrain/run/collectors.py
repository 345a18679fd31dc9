"""Where a step's rollouts come from, and when the engine takes the new weights
(trainer.collect): one interface, three collectors.

    step        take: the step's rollouts collected now, by the policy as it is
                synced: an engine with its own weights takes the new ones after the update
    overlap     take: the rollouts the last step started collecting (by the policy before its
                update: one version behind); taken: the engine takes the weights of the last
                update, and step k+1's collect starts, to run while step k's update runs
    continuous  take: finished groups of those in flight (run/continuous.py); synced: the
                engine takes the new weights, the taken groups leave and new ones launch

The loop (run/trainer.py) calls, each step: take -> taken -> (rows, update) -> synced ->
before_eval -> checkpoint; `close` at the end. `Play` plays rollouts: the run's agent through the
gateway (run/step.collect), named by the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

from tracetrain.config import TrainConfig
from tracetrain.run import continuous
from tracetrain.run.services import Services
from tracetrain.run.state import RunState
from tracetrain.run.step import (
    ENGINE_WORK,
    Collected,
    collect,
    collected_of,
    rollout_specs,
    step_tasks,
)
from tracetrain.run.stop import Stop
from tracetrain.run.weights import WeightSync


@dataclass
class Play:
    """The run's rollouts played by `agent` on the tasks of `task` (and `data`, its dataset)
    through `services`' gateway; their ids start with `nonce` (this process's)."""

    cfg: TrainConfig
    task: Any
    data: Any
    agent: Any
    nonce: str
    lockstep: Any  # agents/lockstep.Lockstep under trainer.reproducible, else None
    services: Services

    async def rollouts(self, tasks: list[dict], prefix: str, n_per_task: int, temperature: float,
                       step: int) -> list:
        """n_per_task rollouts of each of `tasks` (a group each) with step `step`'s seed."""
        s = self.services
        specs = rollout_specs(tasks, n_per_task, prefix)
        return await collect(s.gateway, specs, self.agent, self.cfg, temperature=temperature,
                             step=step, http_client=s.http_client, workers=s.workers,
                             lockstep=self.lockstep)

    async def step(self, step: int) -> Collected:
        """The rollouts of step `step` (its tasks, n per task), with the engine's work and time."""
        cfg, engine, t0 = self.cfg, self.services.engine, time.perf_counter()
        work = [k for k in ENGINE_WORK if k in engine.stats]
        before, version = {k: engine.stats[k] for k in work}, engine.model_version
        tasks = step_tasks(self.task, cfg, step, self.data)
        results = await self.rollouts(tasks, f"{self.nonce}-s{step}", cfg.rollout.n_per_task,
                                      cfg.rollout.temperature, step)
        return Collected(step, results, time.perf_counter() - t0,
                         {k: engine.stats[k] - before[k] for k in work}, version)


class StepCollector:
    """collect "step" (module docstring); the interface every collector has."""

    reruns_eval = True  # a signal's stopped eval is run again by the resumed run

    def __init__(self, play: Play, sync: WeightSync, stop: Stop, log=print):
        self.play, self.sync, self.stop, self.log = play, sync, stop, log
        self.steps = play.cfg.trainer.steps

    def start(self, state: RunState) -> None:
        """Before the first step (after the evals before it)."""

    async def take(self, state: RunState, clock) -> Collected:
        """Step `state.step`'s rollouts: the checkpoint's, if it kept them, else collected now."""
        resumed, state.next_collected = state.next_collected, None
        if resumed is not None and resumed.step == state.step:
            return resumed
        return await self.play.step(state.step)

    async def taken(self, state: RunState) -> None:
        """After `take`, before the step's rows."""

    async def synced(self, state: RunState, updated: bool) -> dict[str, float]:
        """After the step's update (`updated`: there was one): the engine's new weights."""
        return await self.sync.send(self.play.services.gateway, state.version) if updated else {}

    async def before_eval(self, state: RunState) -> None:
        """Before an eval after the step: the engine takes the policy's weights."""
        await self.sync.catch_up(self.play.services.gateway, state.version)

    async def before_eval_again(self, state: RunState) -> None:
        """Before the resumed run runs the eval a signal stopped (`reruns_eval`)."""

    async def checkpoint(self, state: RunState) -> RunState:
        """The run's state as a checkpoint keeps it now."""
        return dataclasses.replace(state, next_collected=None)

    async def close(self, state: RunState, collected: Collected | None) -> None:
        """The collection ends (`collected`: the last rollouts taken): nothing left running."""


class OverlapCollector(StepCollector):
    """collect "overlap" (module docstring): `pending`, the next step's collect."""

    def __init__(self, play: Play, sync: WeightSync, stop: Stop, log=print):
        super().__init__(play, sync, stop, log)
        self.pending: asyncio.Task | None = None
        self.sync_s = 0.0  # the last `taken`'s weight sync (the step's time/sync_s)

    async def take(self, state: RunState, clock) -> Collected:
        if self.pending is None:
            return await super().take(state, clock)
        state.next_collected = None
        collected = await self.pending
        self.pending = None
        return collected

    async def taken(self, state: RunState) -> None:
        self.sync_s = await self.sync.catch_up(self.play.services.gateway, state.version)
        if state.step + 1 < self.steps:
            self.pending = asyncio.create_task(self.play.step(state.step + 1))

    async def synced(self, state: RunState, updated: bool) -> dict[str, float]:
        """The weights go to the engine in the next `taken`; this step's time/sync_s is the
        previous update's sync, done in this step's `taken`."""
        return {"time/sync_s": self.sync_s}

    async def before_eval(self, state: RunState) -> None:
        """The next step's collect finishes on the old weights first; after the last step the
        checkpoint keeps those (what a longer resumed run collects with)."""
        if self.pending is not None:
            await asyncio.wait([self.pending])
        elif state.step >= self.steps:
            self.sync.keep_for_resume()
        await super().before_eval(state)

    async def before_eval_again(self, state: RunState) -> None:
        """As the uninterrupted run: the next step's rollouts collected first (when the
        checkpoint has not them: from the engine's weights, kept for it)."""
        if state.next_collected is None and state.step < self.steps:
            state.next_collected = await self.play.step(state.step)

    async def checkpoint(self, state: RunState) -> RunState:
        collected = await self.stop.until(self.pending) if self.pending is not None else None
        return dataclasses.replace(state, next_collected=collected)

    async def close(self, state: RunState, collected: Collected | None) -> None:
        """Stopped: this step's rollouts kept when collected; the next step's collect cancelled."""
        if state.next_collected is None:
            state.next_collected = collected_of(state.step, collected, self.pending)
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)


class ContinuousCollector(StepCollector):
    """collect "continuous" (module docstring, run/continuous.py): `groups`, those in flight.
    With the engine's own copy of the weights a stopped eval is not run again: the engine holds
    the weights of the groups in flight."""

    def __init__(self, play: Play, sync: WeightSync, stop: Stop, log=print):
        super().__init__(play, sync, stop, log)
        self.reruns_eval = not sync.own_copy
        self.groups: continuous.Collector | None = None

    def start(self, state: RunState) -> None:
        """Group n is played as the step-synchronous run plays it (continuous.group_specs)."""
        p, cfg = self.play, self.play.cfg
        G, n_per_task = cfg.rollout.tasks_per_step, cfg.rollout.n_per_task
        # a step's tasks, made once while its groups launch (the last few steps' kept)
        tasks_of = functools.lru_cache(maxsize=cfg.trainer.max_staleness + 2)(
            lambda step: step_tasks(p.task, cfg, step, p.data))

        s = p.services

        async def play(number: int) -> list:
            specs, step = continuous.group_specs(tasks_of(number // G), number, G, n_per_task,
                                                 p.nonce)
            return await collect(s.gateway, specs, p.agent, cfg, step=step,
                                 temperature=cfg.rollout.temperature, http_client=s.http_client,
                                 workers=s.workers, first_position=(number % G) * n_per_task)

        self.groups = continuous.Collector(
            play, lambda: s.engine.model_version, groups_per_step=G,
            max_staleness=cfg.trainer.max_staleness, last_group=cfg.trainer.steps * G,
            **(state.collector or {}))
        self.groups.launch()

    async def take(self, state: RunState, clock) -> Collected:
        state.next_collected = None
        return await continuous.take_step(self.groups, self.play.services.engine, state.step,
                                          state.version, clock.stats)

    async def synced(self, state: RunState, updated: bool) -> dict[str, float]:
        times = await super().synced(state, updated)
        self.groups.trained()  # (after the engine took the new weights)
        return times

    async def checkpoint(self, state: RunState) -> RunState:
        return dataclasses.replace(state, next_collected=None, collector=self.groups.state())

    async def close(self, state: RunState, collected: Collected | None) -> None:
        """What a resumed run launches again kept (state.collector); the groups still running
        cancelled."""
        if self.groups is None:
            return
        state.collector = self.groups.state()
        if n := await self.groups.aclose():
            self.log(f"continuous collection: {n} groups still running at the end, cancelled")
        self.groups = None


COLLECTORS = {"step": StepCollector, "overlap": OverlapCollector, "continuous": ContinuousCollector}


def collector_for(play: Play, sync: WeightSync, stop: Stop, log=print) -> StepCollector:
    """The collector of trainer.collect."""
    return COLLECTORS[play.cfg.trainer.collect](play, sync, stop, log)
