"""Continuous collection (`trainer.collect: continuous`): agents keep running while the policy
learns, and each step takes groups that have finished.

    group n     the run's n-th group (n = 0, 1, ...): task n % G of step_tasks(n // G), played
                n_per_task times with step n // G's sampling seed (G = rollout.tasks_per_step):
                the tasks, order and seeds of the step-synchronous run
    launch      while fewer than (k + 1) * G groups are launched and not yet trained
                (k = trainer.max_staleness); a group's launch version is the engine's then
    take(s)     step s's groups: every group launched at a version <= s - k (after this update it
                would be more than k versions old: waited for), then finished groups, the first
                launched first, up to G in all (fewer only at the end of the run)
    trained     after the update (and the engine's weight sync) the taken groups leave; new ones
                launch

Staleness: a group taken at step s was launched at a version >= s - k (at step s - 1 it would
have been forced otherwise) and each of its turns was made by a version >= that, so no trained
token is more than k versions old and nothing is dropped for age. Groups are taken whole (a
group's advantage needs all of it). With k = 0, G groups launch, all are waited for, the update
runs, then the next G launch: the step-synchronous run, the same tasks, seeds and samples.

The only I/O is through `play` (the runner through the gateway: run/collectors.py's
ContinuousCollector); the rest is bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Group:
    version: int  # the engine's model version when it was launched
    run: asyncio.Task  # -> the runner's results of its n_per_task rollouts


@dataclass
class Taken:
    """One step's groups: their results (group after group), the oldest launch version and how
    the take went."""

    results: list
    numbers: list[int]
    oldest_version: int
    metrics: dict[str, float] = field(default_factory=dict)


class Collector:
    """The groups in flight of a continuous run (module docstring).

    play(n): a coroutine playing group n (its task, seed and rollout ids are the caller's),
    returning its results; version(): the engine's model version now. `redo`: groups a resumed
    run launches again first (launched, not trained, when its checkpoint was written);
    `next_group`: the first group never launched; `last_group`: no group from it on is launched
    (the run needs steps x G), a saved one (`redo`) included: a run resumed with fewer steps
    plays none past its last step."""

    def __init__(self, play: Callable[[int], Awaitable[list]], version: Callable[[], int], *,
                 groups_per_step: int, max_staleness: int, last_group: int,
                 next_group: int = 0, redo: list[int] | None = None):
        self.play, self.version = play, version
        self.G, self.k, self.last = groups_per_step, max_staleness, last_group
        self.next, self.redo = next_group, sorted(n for n in redo or [] if n < last_group)
        self.groups: dict[int, Group] = {}  # launched, not trained
        self.taken: list[int] = []  # the step's, until `trained`
        self.last_take = time.perf_counter()  # when the last step's groups were taken (or start)

    def launch(self) -> int:
        """Launch groups up to the bound; returns how many."""
        n = 0
        while len(self.groups) < (self.k + 1) * self.G and (self.redo or self.next < self.last):
            number = self.redo.pop(0) if self.redo else self.next
            if number == self.next:
                self.next += 1
            self.groups[number] = Group(self.version(), asyncio.create_task(self.play(number)))
            n += 1
        return n

    async def take(self, version: int) -> Taken:
        """Step `version`'s groups (module docstring): waits for the forced ones and for G
        finished (or for every group left, at the end of the run)."""
        t0 = time.perf_counter()
        forced = {n for n, g in self.groups.items() if g.version <= version - self.k}
        waited = {n for n in forced if not self.groups[n].run.done()}
        while True:
            done = [n for n, g in self.groups.items() if g.run.done()]
            if forced.issubset(done) and len(done) >= min(self.G, len(self.groups)):
                break  # (nothing left at all at the end of the run: an empty take)
            pending = [g.run for g in self.groups.values() if not g.run.done()]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        others = sorted(n for n in done if n not in forced)
        numbers = sorted(forced) + others[:max(0, self.G - len(forced))]
        self.taken = numbers
        results = [r for n in numbers for r in self.groups[n].run.result()]
        oldest = min((self.groups[n].version for n in numbers), default=version)
        return Taken(results, numbers, oldest, {
            "collect/groups_taken": len(numbers),
            "collect/groups_forced": len(forced),
            "collect/groups_waited_for": len(waited),  # forced and not yet finished at the take
            "collect/groups_in_flight": len(self.groups) - len(done),
            "collect/take_wait_s": time.perf_counter() - t0,
        })

    def trained(self) -> int:
        """The taken groups leave; new ones launch (returns how many)."""
        for n in self.taken:
            del self.groups[n]
        self.taken = []
        return self.launch()

    def state(self) -> dict:
        """For a checkpoint: the next group and those launched but not trained (a resumed run
        plays them again; their rollouts so far are in the store, not trained)."""
        return {"next_group": self.next, "redo": sorted(set(self.groups) | set(self.redo))}

    async def aclose(self) -> int:
        """Cancel the groups still running (at the end of the run); returns how many."""
        running = [g.run for g in self.groups.values() if not g.run.done()]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return len(running)


def group_specs(tasks: list[dict], number: int, groups_per_step: int, n_per_task: int,
                nonce: str) -> tuple[list[dict], int]:
    """(rollout specs, step seed) of group `number`: the specs the step-synchronous run gives
    task number % G of step number // G (`tasks`: that step's tasks)."""
    step, j = divmod(number, groups_per_step)
    prefix = f"{nonce}-s{step}-t{j}"
    return [{"rollout_id": f"{prefix}-n{m}", "group_id": prefix, "task": tasks[j]}
            for m in range(n_per_task)], step


async def take_step(c: Collector, engine, step: int, version: int, before: dict):
    """step.Collected for step `step` at policy version `version`: the taken groups' results, the
    seconds since the last take (the step's share of the collection's wall time: rollouts/s is
    its throughput), the engine's work since `before` (its stats then)."""
    from tracetrain.run.step import ENGINE_WORK, Collected

    since = c.last_take
    taken = await c.take(version)
    c.last_take = time.perf_counter()
    work = {k: engine.stats[k] - before.get(k, 0) for k in ENGINE_WORK if k in engine.stats}
    # which groups this step trained (their ids name the step they were dealt from): the viewer's
    groups = list(dict.fromkeys(r.group_id for r in taken.results))
    return Collected(step, taken.results, time.perf_counter() - since, work, taken.oldest_version,
                     {**taken.metrics, "collect/groups": groups})
