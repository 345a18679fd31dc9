"""The runner against a live gateway on loopback: states, rewards, failures kept apart, hung agents
killed at their timeout (coroutines and subprocesses), nothing lost."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from gateway_fixtures import COMMAND_AGENT_SCRIPT, FakeEngine, live_gateway
from openai import AsyncOpenAI

from tracetrain.agents.runner import (
    CommandAgent,
    GatewayClient,
    GatewayError,
    load_agent,
    run_rollouts,
)
from tracetrain.objective.advantage import batch_advantages
from tracetrain.rows.aggregate import aggregate


async def one_call(client: dict) -> str:
    ai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                     http_client=client["http_client"])
    out = await ai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8)
    return out.choices[0].message.content


async def good(task, client):
    await one_call(client)
    return task["reward"]


async def crash_after_call(task, client):
    await one_call(client)
    raise RuntimeError("tool exploded")


async def hang_after_call(task, client):
    await one_call(client)
    await asyncio.sleep(3600)


async def bad_reward(task, client):
    return "lots"


def by_kind(task, client):
    return {"good": good, "crash": crash_after_call, "hang": hang_after_call, "bad": bad_reward}[
        task["kind"]](task, client)


def test_states_rewards_and_failures(tmp_path):
    kinds = ["good"] * 6 + ["crash", "hang", "bad"]
    specs = [
        {"rollout_id": f"r{k}", "group_id": f"g{k % 2}", "task": {"kind": kind, "reward": float(k % 3)}}
        for k, kind in enumerate(kinds)
    ]
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                t = time.monotonic()
                res = await run_rollouts(client, specs, by_kind, concurrency=16, timeout_s=2.0)
                return res, time.monotonic() - t
            finally:
                await client.aclose()

        results, wall = asyncio.run(main())
        assert wall < 10, "a hung agent held the step past its timeout"
        assert [r.rollout_id for r in results] == [s["rollout_id"] for s in specs]
        states = {r.rollout_id: r.state for r in results}
        assert states == {**{f"r{k}": "succeeded" for k in range(6)}, "r6": "failed",
                          "r7": "timed_out", "r8": "failed"}
        assert "tool exploded" in results[6].error
        assert "lots" in results[8].error
        for r in results:
            stored = gw.store.get_rollout(r.rollout_id)
            assert stored.state.value == r.state
            if r.state == "succeeded":
                assert r.reward == stored.reward == float(int(r.rollout_id[1:]) % 3)
            else:
                assert r.reward is None  # never a silent 0

        # Down the data path: failed and timed-out rollouts have turns, but do not train.
        rollouts = gw.store.load_rollouts(rollout_ids=[s["rollout_id"] for s in specs])
        assert len(rollouts) == 9 and all(len(r.turns) == 1 for r in rollouts[:8])
        batch, agg = aggregate(rollouts, max_prompt_length=256, max_response_length=64,
                             pad_token_id=gw.engine.tokenizer.pad_token_id)
        kept, adv, metrics = batch_advantages(batch)
        assert metrics["n_excluded_failed"] == 2  # r6 crashed, r7 timed out
        assert agg["dropped_rollouts/no_turns"] == 1  # r8 never called the model
        assert sorted(kept.rollouts) == [f"r{k}" for k in range(6)]
        assert adv.shape == (6,)




def test_command_agents(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT_SCRIPT)
    pidfile = str(tmp_path / "hung.pid")
    specs = [
        {"rollout_id": "ok", "group_id": "g", "task": {"kind": "ok", "reward": 0.75}},
        {"rollout_id": "exit", "group_id": "g", "task": {"kind": "exit", "reward": 1.0}},
        {"rollout_id": "hang", "group_id": "g", "task": {"kind": "hang", "pidfile": pidfile}},
    ]
    agent = load_agent([sys.executable, str(script)])
    assert isinstance(agent, CommandAgent)
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await run_rollouts(client, specs, agent, concurrency=3, timeout_s=20.0,
                                          client_extra={"model": "policy"})
            finally:
                await client.aclose()

        ok, exited, hung = asyncio.run(main())
        assert (ok.state, ok.reward) == ("succeeded", 0.75)
        assert exited.state == "failed" and "status 3" in exited.error
        assert "the environment broke" in exited.error
        assert hung.state == "timed_out"
        pid = int(open(pidfile).read())
        for _ in range(50):  # the process group was killed
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"hung agent process {pid} is still alive")
        assert len(gw.store.get_turns("ok")) == 1 and len(gw.store.get_turns("exit")) == 1
        assert gw.store.get_rollout("exit").state.value == "failed"


def test_load_agent_forms():
    assert load_agent(good) is good
    assert load_agent("os.path:join") is os.path.join
    assert load_agent("python agent.py").argv == [sys.executable, "agent.py"]


async def no_model_call(task, client):
    return 0.5


def test_agent_that_never_calls_the_model(tmp_path):
    """Still queued when it returns: the runner passes it through running to succeeded."""
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await run_rollouts(client, [{"rollout_id": "q", "group_id": "g"}], no_model_call,
                                          concurrency=1, timeout_s=5.0)
            finally:
                await client.aclose()

        (res,) = asyncio.run(main())
        assert (res.state, res.reward) == ("succeeded", 0.5)
        stored = gw.store.get_rollout("q")
        assert (stored.state.value, stored.reward) == ("succeeded", 0.5)


def test_finishes_of_a_wave_go_together(tmp_path):
    """16 agents ending together: fewer PATCH /rollouts calls than rollouts, every one recorded."""
    specs = [{"rollout_id": f"w{k}", "group_id": "g", "task": {"reward": k / 16}} for k in range(16)]
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            calls = []
            send = client._call

            async def spy(method, path, **kw):
                calls.append((method, path, len(kw.get("json", {}).get("rollouts", []))))
                return await send(method, path, **kw)

            client._call = spy
            try:
                return await run_rollouts(client, specs, good, concurrency=16, timeout_s=10.0), calls
            finally:
                await client.aclose()

        results, calls = asyncio.run(main())
        patches = [n for method, path, n in calls if method == "PATCH"]
        assert all(path == "/rollouts" for method, path, _ in calls if method == "PATCH")
        assert sum(patches) == 16 and len(patches) < 16
        for r in results:
            stored = gw.store.get_rollout(r.rollout_id)
            assert (r.state, r.reward) == ("succeeded", int(r.rollout_id[1:]) / 16)
            assert (stored.state.value, stored.reward) == (r.state, r.reward)


def test_a_refused_bulk_finish_fails_each_of_its_rollouts(tmp_path):
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, "not-the-admin-key")
            try:
                return await asyncio.gather(
                    *(client.finish(f"r{k}", "succeeded", reward=1.0) for k in range(3)),
                    return_exceptions=True)
            finally:
                await client.aclose()

        errors = asyncio.run(main())
        assert all(isinstance(e, GatewayError) and e.status == 401 for e in errors), errors


def test_drain_waits_for_a_request_past_its_timeout(tmp_path):
    """A request still decoding (a timed-out agent's) holds the weight update until it ends,
    however short the drain timeout: the update never runs with a request in flight."""
    with live_gateway(tmp_path, FakeEngine(delay=2.0)) as gw:  # margins for a loaded machine
        (r,) = gw.create()

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                call = asyncio.create_task(one_call({**r, "http_client": None}))
                while gw.app.state.gateway.slots["default"].in_flight == 0:
                    await asyncio.sleep(0.01)
                t = time.monotonic()
                await client.drain("default", timeout_s=0.1)
                waited = time.monotonic() - t
                in_flight = gw.app.state.gateway.slots["default"].in_flight
                await client.engine("default", "resume")
                await call
                return waited, in_flight
            finally:
                await client.aclose()

        waited, in_flight = asyncio.run(main())
        assert in_flight == 0 and waited > 1.0


def test_held_engine_in_process_waits_for_the_request_in_flight(caplog):
    """The trainer's own gateway: the slot is held directly (no HTTP), with the same guarantee."""
    from tracetrain.gateway.slots import EngineSlot
    from tracetrain.run.held import held_engine

    async def main():
        slot = EngineSlot("default", FakeEngine())

        async def request():
            async with slot.admit():
                await asyncio.sleep(2.0)

        call = asyncio.create_task(request())
        while slot.in_flight == 0:
            await asyncio.sleep(0.01)
        t = time.monotonic()
        async with held_engine(None, slot, drain_timeout_s=0.1):
            inside = (slot.in_flight, slot.paused, time.monotonic() - t)
        await call
        return inside, slot.paused

    (in_flight, paused, waited), after = asyncio.run(main())
    assert (in_flight, paused, after) == (0, True, False) and waited > 1.0
    assert "still in flight" in caplog.text


async def two_roles(task, client):
    """A solver and a checker (the model's name is the role); rewards along the way returned with
    the final reward, or posted by the agent itself while it runs."""
    ai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                     http_client=client["http_client"])
    msgs = [{"role": "user", "content": "2+2?"}]
    await ai.chat.completions.create(model="solver", messages=msgs, max_tokens=8)
    if task.get("post"):  # as it runs: the latest turn (the solver's)
        r = await client["http_client"].post(
            f"{client['rollout_url']}/turn-rewards", json={"reward": 0.5, "name": "parsed"},
            headers={"Authorization": f"Bearer {client['api_key']}"})
        r.raise_for_status()
    await ai.chat.completions.create(model="checker", messages=msgs, max_tokens=8)
    given = {0: float("nan")} if task.get("nan") else task["turn_rewards"]
    metrics = {"metrics": task["metrics"]} if "metrics" in task else {}
    return {"reward": 1.0, "turn_rewards": given, **metrics}


def test_a_two_role_agent_returns_rewards_along_the_way(tmp_path):
    specs = [
        {"rollout_id": "ok",
         "task": {"post": True, "turn_rewards": {1: -1.0}, "metrics": {"tool_errors": 2}}},
        {"rollout_id": "named", "task": {"turn_rewards": [{"turn": 0, "reward": 2.0, "name": "x"}]}},
        {"rollout_id": "no-turn", "task": {"turn_rewards": {5: 1.0}}},
        {"rollout_id": "not-int", "task": {"turn_rewards": {"0": 1.0}}},
        {"rollout_id": "nan", "task": {"nan": True}},  # (a task's JSON cannot hold NaN)
        {"rollout_id": "bad-metrics", "task": {"turn_rewards": {}, "metrics": {"tool_errors": "two"}}},
    ]
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await run_rollouts(client, specs, two_roles, concurrency=4, timeout_s=30)
            finally:
                await client.aclose()

        res = {r.rollout_id: r for r in asyncio.run(main())}
        assert (res["ok"].state, res["ok"].reward) == ("succeeded", 1.0)
        turns = gw.store.get_turns("ok")
        assert [(t.role, t.reward) for t in turns] == [("solver", 0.5), ("checker", -1.0)]
        assert turns[0].rewards[0].name == "parsed"
        # its returned metrics: the rollout's `metrics` event (the step's env/* and tools/errors)
        assert [e.payload for e in gw.store.list_events("ok", kind="metrics")] == [{"tool_errors": 2}]
        named = gw.store.get_turns("named")
        assert [(r.name, r.reward) for r in named[0].rewards] == [("x", 2.0)]
        for rid, why in (("no-turn", "no turn 5"), ("not-int", "not a turn index"),
                         ("nan", "turn reward"), ("bad-metrics", "metrics must be {name: number}")):
            assert res[rid].state == "failed" and why in res[rid].error, (rid, res[rid].error)
            assert res[rid].reward is None
