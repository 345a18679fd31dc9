"""Agents in worker processes: the runner's agents off the trainer's event loop.

An agent on the openai SDK spends about as much CPU per model call on its own side (building and
validating the request, parsing the response) as the gateway spends serving it. In one process
both share one event loop and one core; with `rollout.agent_workers = k`, the step's agents run in
k worker processes instead (each with its own event loop and HTTP client, re-importing the task
module), so that work runs beside the gateway and the engine.

The driver keeps the runner's contract (runner.py): it creates the rollouts on the gateway, hands
each worker its share of (task, client, timeout) jobs, and finishes every rollout through the
gateway with the state the worker saw: succeeded with the agent's reward, failed with the error
kept, or timed_out at `timeout_s`. A worker whose event loop is blocked by an agent (past every
timeout plus a margin) is killed with its pool; its unfinished rollouts are timed_out and the next
call starts a fresh pool. Each worker also reports each agent's return at once (a queue read by
a thread of the driver), which keeps a Lockstep's count of live agents (agents/lockstep.py).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracetrain.agents.lockstep import AgentCount, Lockstep
from tracetrain.agents.runner import (
    GatewayClient,
    RolloutResult,
    agent_client,
    call_agent,
    finish_rollout,
)

HANG_MARGIN_S = 10.0  # past the agents' timeout, a worker that has not answered is killed
STARTUP_TIMEOUT_S = 300.0  # a fresh pool's workers import the task module (and torch) first


@dataclass(frozen=True)
class AgentRef:
    """How a worker process finds the agent: the task module (a .py path or a module name, with
    the directory relative paths start from) and the agent's name in it (see tasks.resolve_agent)."""

    task: str
    base_dir: str | None
    agent: str
    env: Any = None  # an envs.Environment (pickled as its config section): its agent plays


# ----------------------------------------------------------------------------- in the worker
_agent = None
_loop: asyncio.AbstractEventLoop | None = None
_http = None
_returns = None  # the driver's queue: the share id of each agent that returned


def _exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """A daemon thread that ends this worker once the process that started it is gone (killed
    with SIGKILL or SIGTERM, it cannot shut the pool down): no orphan keeps running agents."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init(ref: AgentRef, max_connections: int, parent: int, returns) -> None:
    global _agent, _loop, _http, _returns
    _returns = returns
    _exit_with_parent(parent)
    from tracetrain.agents.runner import agent_http_client
    from tracetrain.agents.tasks import load_task, resolve_agent

    if ref.env is not None:
        _agent = ref.env.agent
    else:
        module = load_task(ref.task, Path(ref.base_dir) if ref.base_dir else None)
        _agent = resolve_agent(module, ref.agent)
    _loop = asyncio.new_event_loop()
    asyncio.set_event_loop(_loop)
    _http = agent_http_client(max_connections)  # kept across steps, like the trainer's own


def _ping() -> int:
    return os.getpid()


Outcome = tuple[str, float | None, str | None, float]  # state, reward, error, seconds


def _run_jobs(jobs: list[tuple[Any, dict, float]], concurrency: int, share: int) -> list[Outcome]:
    """Run (task, client, timeout_s) jobs concurrently on this worker's loop -> outcomes; each
    agent's return is reported to the driver as `share` at once."""

    async def run_all():
        sem = asyncio.Semaphore(concurrency)

        async def one(task, client, timeout_s):
            async with sem:
                start = time.monotonic()
                out = await call_agent(_agent, task, {**client, "http_client": _http}, timeout_s)
                _returns.put(share)
                return (*out, time.monotonic() - start)

        return await asyncio.gather(*(one(*job) for job in jobs))

    return _loop.run_until_complete(run_all())


# ----------------------------------------------------------------------------- in the driver
class AgentWorkers:
    """A pool of `n` agent worker processes (spawned on first use, kept across steps)."""

    def __init__(self, ref: AgentRef, n: int, *, max_connections: int = 256,
                 hang_margin_s: float = HANG_MARGIN_S):
        if n < 1:
            raise ValueError(f"agent workers: need n >= 1, got {n}")
        self.ref, self.n, self.max_connections = ref, n, max_connections
        self.hang_margin_s = hang_margin_s
        self._pool: ProcessPoolExecutor | None = None
        self._returns = None  # the workers' queue of agent returns, read by `_reader`
        self._reader: threading.Thread | None = None
        self._shares: dict[int, tuple[asyncio.AbstractEventLoop, AgentCount]] = {}
        self._share_ids = itertools.count()

    def _read_returns(self, queue) -> None:
        """The driver's thread: each agent return, to its share's count, on its event loop."""
        while (share := queue.get()) is not None:
            entry = self._shares.get(share)
            if entry is not None:
                loop, count = entry
                loop.call_soon_threadsafe(count.ended)

    async def _get_pool(self) -> ProcessPoolExecutor:
        """The pool, its workers started and initialised (so that start-up, which imports the
        task module, never counts against an agent's timeout)."""
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._returns = ctx.Queue()
            self._reader = threading.Thread(target=self._read_returns, args=(self._returns,),
                                            name="agent-returns", daemon=True)
            self._reader.start()
            pool = ProcessPoolExecutor(
                self.n, mp_context=ctx, initializer=_init,
                initargs=(self.ref, self.max_connections, os.getpid(), self._returns),
            )
            loop = asyncio.get_running_loop()
            try:  # n concurrent pings: the pool spawns a process for each while none is idle
                await asyncio.wait_for(
                    asyncio.gather(*(loop.run_in_executor(pool, _ping) for _ in range(self.n))),
                    STARTUP_TIMEOUT_S)
            except BaseException:
                self._pool = pool
                self._kill()
                raise
            self._pool = pool
        return self._pool

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for p in list(getattr(pool, "_processes", {}).values()):
                p.kill()
            pool.shutdown(wait=False, cancel_futures=True)
        self._stop_reader()

    def _stop_reader(self) -> None:
        if self._returns is not None:
            self._returns.put(None)
            self._returns = None

    async def run(self, jobs: list[tuple[Any, dict, float]], concurrency: int,
                  lockstep: Lockstep | None = None) -> list[Outcome]:
        """Outcomes of `jobs` in order; jobs are dealt round-robin to the workers. `lockstep`:
        each worker's live agents are counted in it (agents/lockstep.py)."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        pool = await self._get_pool()
        shares = [list(range(w, len(jobs), self.n)) for w in range(min(self.n, len(jobs)))]
        per_worker = max(1, -(-concurrency // len(shares)))
        deadline = max(t for _, _, t in jobs) + self.hang_margin_s
        ids = [next(self._share_ids) for _ in shares]
        for i, share in zip(ids, shares, strict=True):
            self._shares[i] = (loop, AgentCount(lockstep, len(share), per_worker))
        try:
            futures = [loop.run_in_executor(pool, _run_jobs, [jobs[k] for k in share], per_worker, i)
                       for i, share in zip(ids, shares, strict=True)]
            done, pending = await asyncio.wait(futures, timeout=deadline)
        finally:
            for i in ids:
                self._shares.pop(i)[1].close()
        outcomes: list[Outcome | None] = [None] * len(jobs)
        broken = bool(pending)
        for share, fut in zip(shares, futures, strict=True):
            if fut in done and fut.exception() is None:
                for k, outcome in zip(share, fut.result(), strict=True):
                    outcomes[k] = outcome
                continue
            broken = True
            if fut in done:
                state, error = "failed", f"agent worker process failed: {fut.exception()!r}"
            else:
                state, error = "timed_out", f"agent worker did not answer within {deadline:.0f} s (killed)"
            for k in share:
                outcomes[k] = (state, None, error, float(deadline))
        if broken:  # a hung or dead worker: kill the pool, the next call spawns a fresh one
            for fut in pending:  # they end with BrokenProcessPool when the pool dies: expected
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._kill()
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._stop_reader()


async def run_rollouts_in_workers(
    gateway: GatewayClient,
    rollouts: list[dict],
    workers: AgentWorkers,
    *,
    concurrency: int,
    timeout_s: float,
    client_extra: dict | None = None,
    first_position: int = 0,
    lockstep: Lockstep | None = None,
) -> list[RolloutResult]:
    """`runner.run_rollouts` with the agents in `workers`: same rollouts, states and results."""
    created = await gateway.create_rollouts(rollouts)
    extra = dict(client_extra or {})
    jobs = []
    for k, (c, spec) in enumerate(zip(created, rollouts, strict=True)):
        jobs.append((spec["task"], agent_client(c, extra, first_position + k), timeout_s))
    try:
        outcomes = await workers.run(jobs, concurrency, lockstep)
    except BrokenProcessPool as e:  # the pool died before it took the jobs
        workers._kill()
        outcomes = [("failed", None, f"agent worker process failed: {e!r}", 0.0)] * len(jobs)
    return list(await asyncio.gather(*(
        finish_rollout(gateway, c, state, reward, error, seconds)
        for c, (state, reward, error, seconds) in zip(created, outcomes, strict=True)
    )))
