"""The Ray runner on a real local Ray against a live gateway on loopback, agents using the real
openai SDK: the same states, rewards and errors as the local runner; a hung agent's Ray task is
cancelled with force (its worker process dies) within timeout + grace; nothing is lost."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import ray
from gateway_fixtures import COMMAND_AGENT_SCRIPT, FakeEngine, live_gateway
from openai import AsyncOpenAI

from tracetrain.agents.runner import GatewayClient, load_agent, rollout_seed
from tracetrain.agents.runner_ray import run_rollouts_ray
from tracetrain.agents.tasks import load_task, resolve_agent

ROOT = Path(__file__).resolve().parents[2]


# Every test that uses Ray is marked slow: they share one local Ray, whose start alone takes
# 5-15 s on 2 shared cores; once it is up, the small ones take about a second each.
@pytest.fixture(scope="module")
def local_ray():
    # This module's agents are pickled by value: the Ray workers cannot import the test module.
    me = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(me)
    # Keep idle agent workers (Ray's default keeps num_cpus of them): tests start fewer.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        log_to_driver=False,
        _system_config={"num_workers_soft_limit": 4},
    )
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(me)


def pid_dies(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def run(gw, specs, agent, **kw):
    async def main():
        client = GatewayClient(gw.url, gw.admin_key)
        try:
            t = time.monotonic()
            res = await run_rollouts_ray(client, specs, agent, **kw)
            return res, time.monotonic() - t
        finally:
            await client.aclose()

    return asyncio.run(main())


# --- agents (run in Ray workers) ------------------------------------------------------------


async def one_call(client: dict) -> str:
    ai = AsyncOpenAI(
        base_url=client["base_url"],
        api_key=client["api_key"],
        max_retries=0,
        http_client=client["http_client"],
    )
    out = await ai.chat.completions.create(
        model=client["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    return out.choices[0].message.content


async def mixed(task, client):
    """good: `calls` model calls, then returns its reward or reports it through the gateway;
    crash: raises after a call; hang: blocks its event loop after a call (only a kill stops it)."""
    if client["seed"] != rollout_seed(7, task["k"]) or client["rollout_id"] != task["id"]:
        raise AssertionError(f"wrong client config {client}")
    for _ in range(task.get("calls", 1)):
        await one_call(client)
    if task["kind"] == "crash":
        raise RuntimeError("tool exploded")
    if task["kind"] == "hang":
        Path(task["pidfile"]).write_text(str(os.getpid()))
        time.sleep(3600)
    if task["report"]:
        async with httpx.AsyncClient() as http:
            r = await http.post(
                client["rollout_url"] + "/rewards",
                json={"reward": task["reward"]},
                headers={"Authorization": "Bearer " + client["api_key"]},
            )
            r.raise_for_status()
        return None
    return task["reward"]


async def dies(task, client):
    await one_call(client)
    if task["kind"] == "die":
        os._exit(3)  # the worker process itself goes away
    return 1.0


async def never_runs(task, client):
    return 1.0


async def blocks(task, client):
    Path(task["pidfile"]).write_text(str(os.getpid()))
    time.sleep(3600)


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_fifty_agents_with_a_crash_and_a_hang(tmp_path, local_ray):
    pidfile = tmp_path / "hung.pid"
    specs = []
    for k in range(50):
        kind = {17: "crash", 3: "hang"}.get(k, "good")
        task = {
            "k": k,
            "id": f"r{k}",
            "kind": kind,
            "calls": 1 + k % 2,
            "reward": k / 100,
            "report": k % 5 == 0,
            "pidfile": str(pidfile),
        }
        specs.append({"rollout_id": f"r{k}", "group_id": f"g{k // 5}", "task": task})
    timeout_s, kill_grace_s = 8.0, 2.0
    with live_gateway(tmp_path) as gw:
        results, _ = run(
            gw,
            specs,
            mixed,
            concurrency=16,
            timeout_s=timeout_s,
            num_cpus=0.5,
            kill_grace_s=kill_grace_s,
            client_extra={"model": "m", "seed": 7},
        )

        assert [r.rollout_id for r in results] == [s["rollout_id"] for s in specs]
        states = {r.rollout_id: r.state for r in results}
        assert states == {
            **{f"r{k}": "succeeded" for k in range(50)},
            "r17": "failed",
            "r3": "timed_out",
        }
        for r, s in zip(results, specs, strict=True):
            stored = gw.store.get_rollout(r.rollout_id)
            assert stored.state.value == r.state
            if r.state == "succeeded":  # returned (k % 5 != 0) or reported through the gateway
                assert r.reward == stored.reward == s["task"]["reward"]
            else:
                assert r.reward is None and stored.reward is None  # never a silent 0
        crash = results[17]
        assert "tool exploded" in crash.error and "RuntimeError" in crash.error
        assert "tool exploded" in gw.store.get_rollout("r17").error

        # The hung agent blocked its event loop: only the driver's kill could stop it, at
        # timeout + grace after it started, and its worker process is gone.
        hung = results[3]
        assert timeout_s + kill_grace_s - 0.5 <= hung.seconds <= timeout_s + kill_grace_s + 5.0
        assert "cancelled with force" in hung.error
        assert pid_dies(int(pidfile.read_text())), "the hung agent's Ray worker is still alive"

        # Nothing lost: every rollout once in the store, with all the turns its agent made.
        stored = gw.store.load_rollouts()
        assert sorted(r.rollout_id for r in stored) == sorted(s["rollout_id"] for s in specs)
        for r, s in zip(
            gw.store.load_rollouts(rollout_ids=[s["rollout_id"] for s in specs]), specs, strict=True
        ):
            assert r.rollout_id == s["rollout_id"] and len(r.turns) == s["task"]["calls"]
        assert len(gw.engine.calls) == sum(s["task"]["calls"] for s in specs)




@pytest.mark.slow
def test_command_agents_through_ray(tmp_path, local_ray):
    """A command agent in a Ray worker: exit 0 with a reported reward, a non-zero exit (failed,
    stderr kept), and a hang stopped by the worker's own timeout (the process group is killed,
    the worker survives: no force-cancel needed)."""
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT_SCRIPT)
    pidfile = str(tmp_path / "hung.pid")
    specs = [
        {"rollout_id": "ok", "group_id": "g", "task": {"kind": "ok", "reward": 0.75}},
        {"rollout_id": "exit", "group_id": "g", "task": {"kind": "exit", "reward": 1.0}},
    ]
    hang = [{"rollout_id": "hang", "group_id": "g", "task": {"kind": "hang", "pidfile": pidfile}}]
    agent = load_agent([sys.executable, str(script)])
    with live_gateway(tmp_path) as gw:
        # A generous timeout for the two that finish (a subprocess importing openai on 2 loaded
        # cores can take seconds); a short one, well before the driver's kill, for the hang.
        (ok, exited), _ = run(
            gw, specs, agent, concurrency=2, timeout_s=60.0, client_extra={"model": "policy"}
        )
        (hung,), _ = run(
            gw,
            hang,
            agent,
            concurrency=1,
            timeout_s=4.0,
            kill_grace_s=10.0,
            client_extra={"model": "policy"},
        )
        assert (ok.state, ok.reward) == ("succeeded", 0.75)
        assert exited.state == "failed" and exited.reward is None
        assert "status 3" in exited.error and "the environment broke" in exited.error
        assert gw.store.get_rollout("exit").state.value == "failed"
        assert hung.state == "timed_out" and hung.reward is None
        assert "cancelled with force" not in hung.error  # the worker's own timeout stopped it
        assert 4.0 - 0.5 <= hung.seconds < 10.0  # measured from the driver's first item
        assert pid_dies(int(open(pidfile).read())), "the hung command's process is still alive"
        assert len(gw.store.get_turns("ok")) == 1 and len(gw.store.get_turns("exit")) == 1


@pytest.mark.slow
def test_task_module_from_a_file_path(tmp_path, local_ray):
    """The guess example's agent, loaded from its .py path as the trainer does, runs in Ray
    workers (shipped by value: its module is not importable there) and plays real games."""
    module = load_task(str(ROOT / "examples/guess/task.py"))
    agent = resolve_agent(module, "agent")
    tasks = module.tasks(8, seed=3)
    specs = [{"rollout_id": f"q{k}", "group_id": "g", "task": t} for k, t in enumerate(tasks)]
    engine = FakeEngine(reply=lambda k, prompt: "5")  # always guesses 5
    with live_gateway(tmp_path, engine=engine) as gw:
        results, _ = run(
            gw,
            specs,
            agent,
            concurrency=4,
            timeout_s=20.0,
            client_extra={"model": "policy", "max_tokens": 4},
        )
        assert {t["target"] == 5 for t in tasks} == {True, False}  # both outcomes are exercised
        for r, t in zip(results, tasks, strict=True):
            assert (r.state, r.reward) == ("succeeded", 1.0 if t["target"] == 5 else 0.0)
            n_turns = 1 if t["target"] == 5 else t["max_turns"]
            assert len(gw.store.get_turns(r.rollout_id)) == n_turns


@pytest.mark.slow
def test_worker_death_is_a_failure(tmp_path, local_ray):
    specs = [{"rollout_id": k, "group_id": "g", "task": {"kind": k}} for k in ("die", "live")]
    with live_gateway(tmp_path) as gw:
        (died, lived), _ = run(
            gw, specs, dies, concurrency=2, timeout_s=20.0, client_extra={"model": "m"}
        )
        assert died.state == "failed" and died.reward is None and "Ray task" in died.error
        assert (lived.state, lived.reward) == ("succeeded", 1.0)
        assert gw.store.get_rollout("die").state.value == "failed"
        assert len(gw.store.get_turns("die")) == 1  # its turn is kept, not lost


@pytest.mark.slow
def test_agent_ray_cannot_place_fails_at_start_timeout(tmp_path, local_ray):
    """A task no node can run (asks for 64 CPUs of 2) does not hold the step forever."""
    with live_gateway(tmp_path) as gw:
        (res,), wall = run(
            gw,
            [{"rollout_id": "x", "group_id": "g"}],
            never_runs,
            concurrency=1,
            timeout_s=5.0,
            num_cpus=64,
            start_timeout_s=1.0,
        )
        assert res.state == "failed" and "no Ray worker started the agent" in res.error
        assert gw.store.get_rollout("x").state.value == "failed"
        assert wall < 10


def test_bad_arguments_are_named(tmp_path):
    with live_gateway(tmp_path) as gw:
        with pytest.raises(ValueError, match="concurrency"):
            run(gw, [], never_runs, concurrency=0, timeout_s=1.0)
        with pytest.raises(ValueError, match="kill_grace_s"):
            run(gw, [], never_runs, concurrency=1, timeout_s=1.0, kill_grace_s=-1.0)
        with pytest.raises(ValueError, match="http_client"):
            run(
                gw,
                [],
                never_runs,
                concurrency=1,
                timeout_s=1.0,
                client_extra={"http_client": object()},
            )


@pytest.mark.slow
def test_cancelled_step_kills_its_agents(tmp_path, local_ray):
    """The trainer stopping mid-step (its task cancelled) takes the running agents down with it."""
    pidfile = tmp_path / "blocked.pid"
    with live_gateway(tmp_path) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            step = asyncio.ensure_future(
                run_rollouts_ray(
                    client,
                    [{"rollout_id": "b", "group_id": "g", "task": {"pidfile": str(pidfile)}}],
                    blocks,
                    concurrency=1,
                    timeout_s=600.0,
                )
            )
            try:
                for _ in range(300):
                    if pidfile.exists() and pidfile.read_text():
                        break
                    await asyncio.sleep(0.1)
                step.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await step
            finally:
                await client.aclose()

        asyncio.run(main())
        assert pid_dies(int(pidfile.read_text())), "the blocked agent's Ray worker is still alive"


@pytest.mark.slow
def test_train_with_runner_ray_records_and_learns_like_local(tmp_path, local_ray):
    """`runner: ray` in the trainer: the same step as `runner: local` (same rollouts, rewards
    and loss for the same seed), the agents run in Ray workers."""
    import json

    from tracetrain.config import build_config
    from tracetrain.run.trainer import train

    example = Path(__file__).resolve().parents[2] / "examples" / "guess"

    def cfg(run_dir, runner):
        return build_config({"task_args": {"high": 4, "max_turns": 3}}, [
            "task=task.py", f"runner={runner}",
            "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
            "warm_start.steps=3", "warm_start.batch_size=8",
            "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
            "trainer.steps=1", f"trainer.run_dir={run_dir}", "trainer.seed=3",
        ])

    for runner in ("local", "ray"):
        train(cfg(tmp_path / runner, runner), base_dir=example, log=lambda *_: None)
    local, on_ray = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                     for r in ("local", "ray"))
    assert on_ray[0]["n_failed"] == on_ray[0]["n_timed_out"] == 0
    assert on_ray[0]["aggregate/n_rollouts"] == 12
    for key in ("reward_mean", "aggregate/n_rows", "aggregate/tokens/trained"):
        assert on_ray[0][key] == local[0][key], key
    assert on_ray[0]["loss"] == pytest.approx(local[0]["loss"], rel=1e-4, abs=1e-6)


PUBLIC_URL_TASK = '''
import importlib.util
spec = importlib.util.spec_from_file_location("guess_task", {guess!r})
guess = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guess)
tasks = guess.tasks


async def agent(task, client):
    # the URL the trainer's gateway.public_url names, not the loopback address it was created at
    assert client["base_url"].startswith("http://localhost:"), client["base_url"]
    assert client["rollout_url"].startswith("http://localhost:"), client["rollout_url"]
    return await guess.agent(task, client)
'''


@pytest.mark.slow
def test_train_with_runner_ray_hands_agents_the_public_url(tmp_path, local_ray):
    """`gateway.public_url` in the trainer is what its Ray agents are told (and can reach)."""
    import json

    from tracetrain.config import build_config
    from tracetrain.run.trainer import train

    task = tmp_path / "public_task.py"
    task.write_text(PUBLIC_URL_TASK.format(guess=str(ROOT / "examples/guess/task.py")))
    cfg = build_config({"task_args": {"high": 4, "max_turns": 3}}, [
        f"task={task}", "runner=ray", "gateway.public_url=http://localhost:{port}",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.timeout_s=60",
        "trainer.steps=1", f"trainer.run_dir={tmp_path / 'run'}",
    ])
    train(cfg, log=lambda *_: None)
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["n_failed"] == m["n_timed_out"] == 0, m
    assert m["aggregate/n_rollouts"] == 4
