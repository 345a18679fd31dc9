"""The Ray runner (`runner: ray`): the same rollouts as `runner.run_rollouts`, each agent run as a
Ray task, so agents spread over the machines of a Ray cluster.

Only the agent runs remotely. The driver creates the rollouts (and their keys) on the gateway,
hands each Ray task the rollout's `client` config, and finishes every rollout through the gateway
with the same code as the local runner (`runner.finish_rollout`). The worker runs the agent in its
own event loop with its own HTTP client for the openai SDK (`client["http_client"]`), under the
same `runner.call_agent` as the local runner: same states, same errors, same reward checks.

Timeouts, in two layers, both measured from the moment the agent starts in its worker (time
queued in Ray, waiting for a free slot or a new worker process, is not the agent's time):
    1. in the worker, `asyncio.wait_for(agent, timeout_s)`: a cooperative agent is cancelled (a
       command agent's process group is killed) and the task returns `timed_out`; the worker
       survives for the next rollout.
    2. in the driver, at `timeout_s + kill_grace_s`: an agent that blocks its event loop, or a
       stuck worker, has its Ray task cancelled with `force=True` (Ray kills the worker process);
       the rollout is `timed_out`. A hung agent never holds the step longer than that.
The start is signalled by the task itself: it is a streaming generator that yields once when the
agent starts, then yields the agent's (state, reward, error). A worker that dies (segfault,
os._exit, OOM kill) makes the rollout `failed` with Ray's error kept. Ray never retries an agent
(`max_retries=0`): a rerun would add turns to a rollout that already has some.

Shipping the agent: it is `ray.put` once per call and serialised by Ray's cloudpickle. A task
module loaded from a file path (`tasks.load_task("examples/guess/task.py")`) is not in
`sys.modules`, so cloudpickle sends its agent function *by value*, with the module-level
functions and constants it uses; the packages it imports (openai, ...) go by reference and must be
installed on the workers, as tracetrain must. A function of an importable module
(`mypkg.agents:agent`) goes by reference: the workers import it, so the package must be installed
there (or shipped with a Ray `runtime_env`). A command agent (`runner.CommandAgent`) is plain data;
its argv must make sense on the worker machines.

Resources: each agent task asks for `num_cpus` (default 0.25) CPUs, which caps the agent worker
processes Ray runs at once on a node at node_CPUs / num_cpus (8 on a 2-CPU machine); `concurrency`
caps the tasks in flight over the whole cluster. Fractional, not 0: with `num_cpus=0` Ray would
start one worker process per task in flight (about 100-200 MB and a second of CPU each). Agents
that compute (compile, run tests) should ask for 1 or more. Ray keeps only num_CPUs idle workers
per node and kills the rest after a second: with fractional `num_cpus` each step then starts some
again; set RAY_num_workers_soft_limit (before `ray start` / `ray.init`) to the agent slots per
node to keep them.

A command agent's subprocess runs in its own process group, which the worker's own timeout kills.
The driver's force-kill comes only when that timeout did not return within `kill_grace_s`, which a
command agent (it only awaits its process) does not cause; were it to happen, the group would
outlive the worker.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any

import ray
from ray.exceptions import RayError

from tracetrain.agents.runner import (
    AgentFn,
    GatewayClient,
    RolloutResult,
    agent_client,
    agent_http_client,
    call_agent,
    finish_rollout,
)


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS); with neither, start a local Ray
    without its dashboard. Does nothing when this process is already connected."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False)


async def _agent_in_worker(
    agent: AgentFn, task: Any, client: dict, timeout_s: float
) -> tuple[str, float | None, str | None]:
    async with agent_http_client(1) as http_client:
        return await call_agent(agent, task, {**client, "http_client": http_client}, timeout_s)


@ray.remote(num_returns="streaming", max_retries=0, retry_exceptions=False)
def _agent_task(agent: AgentFn, task: Any, client: dict, timeout_s: float):
    """One rollout's agent in a Ray worker: yields the worker's pid when it starts, then
    (state, reward, error) from `runner.call_agent` in a fresh event loop."""
    yield os.getpid()
    yield asyncio.run(_agent_in_worker(agent, task, client, timeout_s))


async def _run_remote(
    agent_ref: Any,
    task: Any,
    client: dict,
    timeout_s: float,
    kill_grace_s: float,
    start_timeout_s: float | None,
    options: dict,
) -> tuple[str, float | None, str | None, float]:
    """Launch one agent task and wait for it under the timeouts -> (state, reward, error, seconds)."""
    stream = _agent_task.options(**options).remote(agent_ref, task, client, timeout_s)
    start = time.monotonic()
    try:
        try:
            await (await asyncio.wait_for(stream.__anext__(), start_timeout_s))
        except asyncio.TimeoutError:
            ray.cancel(stream, force=True)
            return (
                "failed",
                None,
                f"no Ray worker started the agent within {start_timeout_s} s",
                time.monotonic() - start,
            )
        start = time.monotonic()
        try:
            state, reward, error = await (
                await asyncio.wait_for(stream.__anext__(), timeout_s + kill_grace_s)
            )
        except asyncio.TimeoutError:
            ray.cancel(stream, force=True)  # kills the worker process
            return (
                "timed_out",
                None,
                f"agent did not finish within {timeout_s} s; its Ray task "
                "was cancelled with force (worker killed)",
                time.monotonic() - start,
            )
    except asyncio.CancelledError:  # the step itself was cancelled: take the agent down with it
        ray.cancel(stream, force=True)
        raise
    except RayError as e:  # the worker died, or the agent could not be loaded there
        error = re.sub(r"\x1b\[[0-9;]*m", "", f"Ray task of the agent failed: {e}")  # no colours
        return "failed", None, error[-8000:], time.monotonic() - start
    except StopAsyncIteration:  # cannot happen with `_agent_task`; kept apart all the same
        return (
            "failed",
            None,
            "Ray task of the agent ended without a result",
            time.monotonic() - start,
        )
    return state, reward, error, time.monotonic() - start


async def run_rollouts_ray(
    gateway: GatewayClient,
    rollouts: list[dict],
    agent: AgentFn,
    *,
    concurrency: int,
    timeout_s: float,
    client_extra: dict | None = None,
    address: str | None = None,
    num_cpus: float = 0.25,
    kill_grace_s: float = 5.0,
    start_timeout_s: float | None = None,
    first_position: int = 0,
) -> list[RolloutResult]:
    """`runner.run_rollouts` with each agent in a Ray task: create `rollouts`
    ([{rollout_id, group_id, task}]) on the gateway, run one agent each, at most `concurrency` at
    a time; results in the order of `rollouts`.

    `address`: the Ray cluster (else $RAY_ADDRESS, else a local Ray; see `connect`); a process
    already connected to Ray uses that connection. `num_cpus`: Ray CPUs per agent task.
    `kill_grace_s`: how long past `timeout_s` the driver waits for the worker's own timeout before
    force-cancelling the task. `start_timeout_s`: how long an agent may wait for Ray to start it
    (queued behind others, waiting for a node); past it the rollout is `failed`; None waits.
    `client_extra` goes to the workers, so it must pickle (no HTTP client: each worker makes its
    own).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if not num_cpus >= 0:
        raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
    if not kill_grace_s >= 0:
        raise ValueError(f"kill_grace_s must be >= 0, got {kill_grace_s}")
    if "http_client" in (client_extra or {}):
        raise ValueError(
            "client_extra['http_client'] cannot go to a Ray worker; each worker makes its own"
        )
    connect(address)
    created = await gateway.create_rollouts(rollouts)
    agent_ref = ray.put(agent)
    options = {"num_cpus": num_cpus}
    sem = asyncio.Semaphore(concurrency)
    extra = dict(client_extra or {})

    async def bounded(k: int, c: dict, task: Any) -> RolloutResult:
        async with sem:
            state, reward, error, seconds = await _run_remote(
                agent_ref,
                task,
                agent_client(c, extra, k),
                timeout_s,
                kill_grace_s,
                start_timeout_s,
                options,
            )
            return await finish_rollout(gateway, c, state, reward, error, seconds)

    runs = (
        bounded(first_position + k, c, r.get("task"))
        for k, (c, r) in enumerate(zip(created, rollouts, strict=True))
    )
    return list(await asyncio.gather(*runs))
