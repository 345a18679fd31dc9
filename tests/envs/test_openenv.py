"""OpenEnv environments (env.openenv) against the real openenv-core: the counter of
openenv_counter.py, served in-process from its `app` or by a uvicorn subprocess on 127.0.0.1
(`base_url`), trains 2 steps with the tool `step` called through the gateway, token-exact across
turns, each step's reward the reward of the model call that made it; a server whose step raises
or hangs fails that rollout only."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, hermes_call, live_gateway

from tracetrain.agents.tasks import open_task_data
from tracetrain.config import build_config
from tracetrain.envs import load_object, load_source
from tracetrain.models.tiny import build_tokenizer
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

SUPPORT = Path(__file__).resolve().parents[1] / "support"
COUNTER = SUPPORT / "openenv_counter.py"
PLUGIN = str(SUPPORT / "scripted_policy.py")
ENGINE = {"kind": "scripted_tools"}  # scripted_policy.py's engine


@pytest.fixture(autouse=True)
def plugin_registered(clean_registries):
    """engine.kind scripted_tools (a config's plugin) for each test only: the tests that enumerate
    the registries never see it."""


@pytest.fixture(scope="module")
def server_url():
    """The counter served by `python openenv_counter.py` (uvicorn, 127.0.0.1, a free port)."""
    proc = subprocess.Popen([sys.executable, str(COUNTER)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("URL="), line
        yield line.strip().removeprefix("URL=")
    finally:
        proc.kill()
        proc.wait()


def config(tmp_path: Path, env: dict, *overrides: str, rows: list[dict] | None = None):
    data = {}
    if rows is not None:
        (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = {"train": str(tmp_path / "train.jsonl")}
    return build_config({"plugins": [PLUGIN], "engine": ENGINE, "env": {"kind": "openenv", **env},
                         "data": data}, [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.max_tokens=64",
        "rollout.timeout_s=20", "aggregate.max_prompt_length=1024",
        "aggregate.max_response_length=512", "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}",
        *overrides])


def stored(run_dir: Path) -> list:
    store = SQLiteStore(run_dir / "traces.db")
    try:
        return [(r, store.get_turns(r.rollout_id)) for r in store.list_rollouts(limit=1000)]
    finally:
        store.close()


def steps_taken(tok, turns) -> list[int]:
    """The `add` of each step the model's replies called."""
    out = []
    for t in turns:
        text = tok.decode(t.response_ids, skip_special_tokens=True)
        if text.startswith("<tool_call>"):
            call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call["name"] == "step"
            out.append(call["arguments"]["add"])
    return out


def check_trained(tmp_path: Path, first_seed: int) -> None:
    """Every rollout succeeded, exact after its first turn, and its turn rewards are the counter's
    step rewards, their sum its reward; the steps had no breaks and updated the policy."""
    tok = build_tokenizer()
    rollouts = stored(tmp_path / "run")
    assert len(rollouts) == 2 * 2 * 2
    for record, turns in rollouts:
        assert record.state.value == "succeeded", record.error
        assert len(turns) >= 2 and all(t.context == "exact" for t in turns[1:])
        target, total, expected = 6 + record.task["seed"] % 5, 0, []
        for add in steps_taken(tok, turns):
            total += add
            expected.append(-abs(target - total) / 10)
            if total >= target:
                break
        assert [t.reward for t in turns[: len(expected)]] == pytest.approx(expected)
        assert all(t.reward is None for t in turns[len(expected):])
        assert record.reward == pytest.approx(sum(expected))
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["aggregate/breaks/total"] for m in steps] == [0, 0]
    assert any(m["grad_norm"] > 0 for m in steps)
    # the agent's returned metrics reach the step: every call was a valid `step` (tools/*)
    assert [(m["tools/errors"], m["tools/unknown"], m["env/tool_errors"]) for m in steps] == [(0, 0, 0)] * 2
    assert {r.task["seed"] for r, _ in rollouts} <= set(range(first_seed, first_seed + 6))


def test_seed_rows_the_step_tool_and_a_rollout_through_the_gateway(tmp_path):
    env = load_source(config(tmp_path, {"client": f"{COUNTER}:CounterClient",
                                        "app": f"{COUNTER}:app", "size": 6, "seed": 10}))
    data = open_task_data(config(tmp_path, {"client": f"{COUNTER}:CounterClient",
                                            "app": f"{COUNTER}:app", "size": 6, "seed": 10}), None, env)
    assert [env.rows()[i] for i in range(6)] == [{"seed": s} for s in range(10, 16)]
    assert len(data.train_tasks(0, 6)) == 6
    try:
        with live_gateway(tmp_path, ScriptedEngine()) as gw:
            (r,) = gw.create(1)
            gw.engine.say(hermes_call("step", {"add": "x"}))  # refused by the Action: told
            gw.engine.say(hermes_call("step", {"add": 2}))
            gw.engine.say(hermes_call("step", {"add": 6}))  # 8 >= target 6 + 12 % 5 = 8: done
            client = {"base_url": r["base_url"], "api_key": r["api_key"], "model": "policy",
                      "max_tokens": 64}
            out = asyncio.run(env.agent({"seed": 12}, client))
            assert out == {"reward": pytest.approx(-0.6 + 0.0), "turn_rewards": {1: -0.6, 2: 0.0},
                           "metrics": {"tool_errors": 1}}  # the refused call
            turns = gw.store.get_turns(r["rollout_id"])
            assert len(turns) == 3 and [t.context for t in turns[1:]] == ["exact", "exact"]
            last = gw.engine.tokenizer.decode(turns[-1].prompt_ids)
            assert '"name": "step", "description": "Add a number to the counter."' in last
            assert '<|im_start|>user\n{"total": 0, "target": 8}<|im_end|>' in last
            assert "<|im_start|>tool\n{'error': " in last and "valid integer" in last
            assert '<|im_start|>tool\n{"total": 2, "target": 8}<|im_end|>' in last
            gw.admin.close()
    finally:
        env.close()


@pytest.mark.parametrize("where", ["in-process", "agent-workers"])
def test_an_app_served_in_process_trains(tmp_path, where):
    """`app`: served by the process that plays the rollouts (an agent worker serves its own)."""
    env = {"client": f"{COUNTER}:CounterClient", "app": f"{COUNTER}:app", "size": 6, "seed": 0}
    cfg = config(tmp_path, env, *(["rollout.agent_workers=1"] if where == "agent-workers" else []))
    try:
        out = train(cfg, log=lambda *_: None)
    finally:
        load_source(cfg).close()  # the server this process started
    assert out["steps"] == 2 and out["failed_rollouts"] == 0
    check_trained(tmp_path, 0)


def test_a_running_server_trains_with_a_generic_client(tmp_path, server_url):
    """base_url, and openenv's GenericEnvClient: the step tool from the server's /schema."""
    env = {"client": "openenv.core.generic_client:GenericEnvClient", "base_url": server_url}
    rows = [{"seed": 20 + i} for i in range(6)]
    out = train(config(tmp_path, env, rows=rows), log=lambda *_: None)
    assert out["steps"] == 2 and out["failed_rollouts"] == 0
    check_trained(tmp_path, 20)


def test_a_step_that_raises_or_hangs_fails_its_rollout_only(tmp_path):
    env = {"client": f"{COUNTER}:CounterClient", "app": f"{COUNTER}:app"}
    rows = [{"seed": 1, "mode": mode} for mode in ("ok", "raise", "hang")]
    release = load_object(f"{COUNTER}:RELEASE", "test")
    cfg = config(tmp_path, env, "rollout.timeout_s=3", "rollout.tasks_per_step=3", rows=rows)
    try:
        out = train(cfg, log=lambda *_: None)
    finally:
        release.set()
        load_source(cfg).close()
    assert out["steps"] == 2
    by_mode: dict[str, list] = {}
    for record, _ in stored(tmp_path / "run"):
        by_mode.setdefault(record.task["mode"], []).append(record)
    assert {m: len(rs) for m, rs in by_mode.items()} == {"ok": 4, "raise": 4, "hang": 4}
    assert all(r.state.value == "succeeded" for r in by_mode["ok"])
    for r in by_mode["raise"]:
        assert r.state.value == "failed" and "the counter server broke in step" in r.error
        assert "Traceback" in r.error
    for r in by_mode["hang"]:
        assert r.state.value == "timed_out" and "did not finish within 3.0 s" in r.error
