"""Agents in worker processes (`rollout.agent_workers`) against a live gateway on loopback: the
same states, rewards and errors as the in-process runner, a hung agent timed out, an agent that
blocks its worker's event loop timed out by killing the worker (and the next call works), and
nothing lost or duplicated in the store."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest
from gateway_fixtures import live_gateway

from tracetrain.agents.runner import GatewayClient
from tracetrain.agents.workers import AgentRef, AgentWorkers, run_rollouts_in_workers

TASK_MODULE = textwrap.dedent(
    """
    import asyncio, os, time
    from openai import AsyncOpenAI

    def tasks(n, *, seed):
        return [{"kind": "good", "reward": 1.0}] * n

    async def agent(task, client):
        if task["kind"] == "blocks":  # blocks its event loop: only killing the process stops it
            time.sleep(3600)
        ai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client["http_client"])
        out = await ai.chat.completions.create(model=client["model"], max_tokens=8,
                                               messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content is not None
        if task["kind"] == "crash":
            raise RuntimeError("tool exploded in pid %d" % os.getpid())
        if task["kind"] == "hang":
            await asyncio.sleep(3600)
        return task["reward"]
    """
)


def specs(kinds, prefix):
    return [{"rollout_id": f"{prefix}{k}", "group_id": f"{prefix}g{k % 3}",
             "task": {"kind": kind, "reward": float(k % 4) / 4}} for k, kind in enumerate(kinds)]


@pytest.mark.slow
def test_agents_in_two_workers_keep_the_runner_contract(tmp_path):
    module = tmp_path / "task_mod.py"
    module.write_text(TASK_MODULE)
    workers = AgentWorkers(AgentRef(str(module), None, "agent"), 2, max_connections=32, hang_margin_s=5.0)
    kinds = ["good"] * 20 + ["crash", "hang"]
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                first = await run_rollouts_in_workers(client, specs(kinds, "a"), workers, concurrency=32,
                                                      timeout_s=8.0, client_extra={"model": "m"})
                t = time.monotonic()
                blocked = await run_rollouts_in_workers(
                    client, specs(["good", "blocks", "good", "good"], "b"), workers, concurrency=8,
                    timeout_s=1.0, client_extra={"model": "m"})
                blocked_wall = time.monotonic() - t
                after = await run_rollouts_in_workers(client, specs(["good"] * 4, "c"), workers,
                                                      concurrency=8, timeout_s=8.0,
                                                      client_extra={"model": "m"})
                return first, blocked, blocked_wall, after
            finally:
                await client.aclose()
                workers.close()

        first, blocked, blocked_wall, after = asyncio.run(main())
        assert [r.rollout_id for r in first] == [f"a{k}" for k in range(len(kinds))]
        for k, r in enumerate(first[:20]):
            assert (r.state, r.reward) == ("succeeded", float(k % 4) / 4)
        assert first[20].state == "failed" and "tool exploded" in first[20].error
        assert first[21].state == "timed_out" and first[21].reward is None
        # The stored records agree, one per rollout, each with its one turn.
        stored = gw.store.load_rollouts(rollout_ids=[r.rollout_id for r in first])
        assert [r.rollout_id for r in stored] == [r.rollout_id for r in first]
        assert all(len(r.turns) == 1 for r in stored)
        for r, s in zip(first, stored, strict=True):
            assert s.state == r.state and s.reward == r.reward
        # A blocked event loop: that worker's share is timed out (the others in it never ran
        # their turn) and the call returns within timeout + the kill margin.
        assert blocked_wall < 1.0 + 5.0 + 10
        assert blocked[1].state == "timed_out" and "killed" in blocked[1].error
        assert {r.state for r in blocked} <= {"succeeded", "timed_out"}
        # A fresh pool serves the next call.
        assert [r.state for r in after] == ["succeeded"] * 4


DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from tracetrain.agents.workers import AgentRef, AgentWorkers

    async def main():
        workers = AgentWorkers(AgentRef(sys.argv[1], None, "agent"), 2, max_connections=4)
        pool = await workers._get_pool()
        print(" ".join(str(p) for p in pool._processes), flush=True)
        await asyncio.sleep(3600)

    if __name__ == "__main__":  # the workers are spawned: they import this file again
        asyncio.run(main())
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_workers_exit_when_the_trainer_is_killed(tmp_path, sig):
    """A trainer killed with no chance to shut its pool down leaves no worker running."""
    import os
    import signal
    import subprocess
    import sys

    module = tmp_path / "task_mod.py"
    module.write_text(TASK_MODULE)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(module)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(proc.pid, getattr(signal, sig))
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), f"workers {pids} outlived the trainer"
    finally:
        proc.kill()
