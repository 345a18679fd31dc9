"""verifiers environments against the real packages (no fakes of verifiers): the environments are
small local modules (tests/support/vf_envs), found through `env.verifiers.path` as a user's own
module on PYTHONPATH would be.

classic (verifiers 0.3, in .venv): rows are its dataset and eval_dataset; it trains with its
rubric's reward recorded (checked against the rubric computed here on the recorded reply), in the
run's process and in agent worker processes; per-step rewards are turn rewards; a tool env plays
through the gateway token-exactly. verifiers.v1 (0.4, in .venv-verifiers, a worker process): it
trains with its task's reward recorded; a two-agent env records two roles; once
scripts/install-verifiers.sh has run, it plays with no network. Environments that fail
(at load, in a rollout, in a reward, by hanging) fail with a clear error: the run before training,
or the rollout, never the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pickle
import sys
import time
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, hermes_call, live_gateway

from tracetrain.agents.runner import call_agent
from tracetrain.agents.tasks import open_task_data
from tracetrain.config import ConfigError, build_config
from tracetrain.envs import EnvError, load_source, verifiers_env
from tracetrain.models.tiny import build_tokenizer
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "tests" / "support" / "vf_envs"
sys.path.insert(0, str(ENVS))  # the expected rewards below are computed with the modules' own code

import vf_digits  # noqa: E402
import vf_turns  # noqa: E402


def verifiers_python() -> Path:
    """.venv-verifiers's python (scripts/install-verifiers.sh: verifiers 0.4 pins openai<3); the
    test is skipped without it, and fails in CI, which installs it."""
    python = ROOT / ".venv-verifiers" / "bin" / "python"
    if not python.exists():
        why = "no .venv-verifiers (bash scripts/install-verifiers.sh)"
        if os.environ.get("CI"):
            pytest.fail(why + ": CI installs it", pytrace=False)
        pytest.skip(why)
    return python


def config(tmp_path: Path, env: dict, *overrides: str, data: dict | None = None, roles: dict | None = None):
    return build_config({"env": {"kind": "verifiers", "path": [str(ENVS)], **env}, "data": data or {},
                         **({"roles": roles} if roles else {})}, [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.max_tokens=8",
        "rollout.timeout_s=60", "trainer.steps=2", "trainer.eval_every=0",
        f"trainer.run_dir={tmp_path / 'run'}", *overrides])


def recorded(run_dir: Path) -> list[dict]:
    """Every trained rollout the store holds: state, reward, turns (role, reply text, turn
    reward, ids), task, its `metrics` event."""
    tok = build_tokenizer()
    store = SQLiteStore(run_dir / "traces.db")
    try:
        out = []
        for r in store.list_rollouts(limit=1000):
            if r.group_id.startswith("eval"):
                continue
            turns = store.get_turns(r.rollout_id)
            events = [e.payload for e in store.list_events(r.rollout_id, "metrics")]
            out.append({"state": r.state.value, "reward": r.reward, "task": r.task, "error": r.error,
                        "metrics": events[0] if events else None,
                        "turns": [{"role": t.role, "reward": t.reward, "prompt": list(t.prompt_ids),
                                   "response": list(t.response_ids),
                                   "text": tok.decode(t.response_ids, skip_special_tokens=True)}
                                  for t in turns]})
        return out
    finally:
        store.close()


def gateway_client(r: dict, **sampling) -> dict:
    return {"base_url": r["base_url"], "api_key": r["api_key"], "model": "policy",
            "rollout_url": r["base_url"].removesuffix("/v1"), "max_tokens": 16, "temperature": 1.0,
            **sampling}


# --- classic (verifiers 0.3, this venv) -------------------------------------------------------


def test_classic_rows_are_its_dataset_and_its_eval_dataset(tmp_path):
    import verifiers as vf

    cfg = config(tmp_path, {"env_id": "vf-digits", "args": {"num_rows": 10, "num_eval": 3}})
    env = load_source(cfg)
    direct = vf.load_environment("vf-digits", num_rows=10, num_eval=3)
    rows, held = env.rows(), env.eval_rows()
    assert len(rows) == 10 and len(held) == 3
    assert [rows[i] for i in range(10)] == [json.loads(json.dumps(dict(r))) for r in direct.get_dataset()]
    assert rows[3]["prompt"][-1] == {"role": "user", "content": "What is 3 plus 4?"}
    assert rows[3]["answer"] == "7" and held[2]["answer"] == "4"
    data = open_task_data(cfg, None, env)  # the eval passes play its eval_dataset
    assert data.eval_tasks(10) == [held[i] for i in range(3)]
    again = pickle.loads(pickle.dumps(env))  # a worker process rebuilds it from its config
    assert "classic" not in again.__dict__ and again.rows()[9] == rows[9]
    capped = load_source(config(tmp_path, {"env_id": "vf-digits", "max_rows": 4}))
    assert len(capped.rows()) == 4 and len(capped.eval_rows()) == 4


@pytest.mark.parametrize("where", ["in-process", "agent-workers"])
def test_classic_trains_with_its_rubrics_reward_recorded(tmp_path, where):
    cfg = config(tmp_path, {"env_id": "vf-digits"},
                 *(["rollout.agent_workers=1"] if where == "agent-workers" else []))
    assert train(cfg, log=lambda *_: None)["steps"] == 2
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 2 * 2 * 2 and all(r["state"] == "succeeded" for r in rollouts)
    for r in rollouts:  # the rubric's reward of the reply the store holds, computed here
        (turn,) = r["turns"]
        assert r["reward"] == pytest.approx(vf_digits.expected_reward(turn["text"]))
        text = turn["text"]
        assert r["metrics"] == {"has_digit": float(any(c.isdigit() for c in text)),
                                "brevity": pytest.approx(1 - min(len(text), 40) / 40), "num_turns": 1.0}
    assert len({r["reward"] for r in rollouts}) > 1  # the rewards differ: the check can fail


@pytest.mark.slow
def test_classic_trains_with_agents_on_ray(tmp_path):
    """`runner: ray`: the environment travels to the Ray workers as its config section and is
    loaded there; one step's rollouts all succeed with the rubric's reward."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        train(config(tmp_path, {"env_id": "vf-digits"}, "runner=ray", "trainer.steps=1"),
              log=lambda *_: None)
    finally:
        ray.shutdown()
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 4 and all(r["state"] == "succeeded" for r in rollouts)
    for r in rollouts:
        assert r["reward"] == pytest.approx(vf_digits.expected_reward(r["turns"][0]["text"]))


def test_classic_multi_turn_steps_are_turn_rewards(tmp_path):
    cfg = config(tmp_path, {"env_id": "vf_turns"}, "trainer.steps=1", "rollout.max_tokens=4",
                 "aggregate.max_prompt_length=512")
    train(cfg, log=lambda *_: None)
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 4 and all(r["state"] == "succeeded" for r in rollouts)
    for r in rollouts:
        turns = r["turns"]
        assert len(turns) == 3  # three model calls, each its step
        assert [t["reward"] for t in turns] == [vf_turns.step_reward(t["text"]) for t in turns]
        assert r["reward"] == pytest.approx(sum(t["reward"] for t in turns) / 3)
        for a, b in zip(turns, turns[1:], strict=False):  # each turn's context extends the last exactly
            assert b["prompt"][:len(a["prompt"]) + len(a["response"])] == a["prompt"] + a["response"]


def test_classic_tool_env_calls_its_tool_through_the_gateway(tmp_path):
    env = load_source(config(tmp_path, {"env_id": "vf_calc"}))
    row = env.rows()[0]
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        gw.engine.say(hermes_call("add", {"a": 2, "b": 3}))
        gw.engine.say("5")
        assert asyncio.run(env.agent(row, gateway_client(r, max_tokens=64))) == 1.0  # its rubric: right
        first, second = gw.store.get_turns(r["rollout_id"])
        tok = gw.engine.tokenizer
        assert '"name": "add"' in tok.decode(first.prompt_ids)  # its tool, offered by verifiers
        assert list(second.prompt_ids[:len(first.prompt_ids) + len(first.response_ids)]) == \
            list(first.prompt_ids) + list(first.response_ids)  # token-exact across the tool call
        assert "5" in tok.decode(second.prompt_ids[len(first.prompt_ids) + len(first.response_ids):])
        gw.admin.close()


@pytest.mark.parametrize("where, error", [
    ("rollout", "the environment broke in env_response"),
    ("reward", "the reward function broke"),
])
def test_a_classic_env_that_raises_fails_its_rollout_with_the_error(tmp_path, where, error):
    env = load_source(config(tmp_path, {"env_id": "vf_broken", "args": {"where": where}}))
    with live_gateway(tmp_path) as gw:
        (r,) = gw.create(1)
        state, reward, text = asyncio.run(call_agent(env.agent, env.rows()[0], gateway_client(r), 30))
        assert (state, reward) == ("failed", None)
        assert error in text and "Traceback" in text
        gw.admin.close()


def test_classic_errors_name_the_key(tmp_path):
    with pytest.raises(EnvError, match=r"config key 'env'.*Could not import 'vf-nope'"):
        load_source(config(tmp_path, {"env_id": "vf-nope", "api": "classic"})).rows()
    with pytest.raises(EnvError, match=r"config key 'env'.*broke while loading"):
        load_source(config(tmp_path, {"env_id": "vf_broken", "args": {"where": "load"}})).rows()
    with pytest.raises(EnvError, match=r"config key 'env'.*unexpected keyword argument 'nope'"):
        load_source(config(tmp_path, {"env_id": "vf-digits", "args": {"nope": 1}})).rows()
    with pytest.raises(ConfigError, match=r"env\.path.*no folder 'no/such/folder'"):
        config(tmp_path, {"env_id": "vf-digits", "path": ["no/such/folder"]})
    # an interpreter without verifiers: the worker says so
    bare = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else pytest.skip("no /usr/bin/python3")
    with pytest.raises(EnvError, match=r"config key 'env'.*no verifiers in .*install-verifiers"):
        load_source(config(tmp_path, {"env_id": "vf-digits", "python": bare})).rows()
    with pytest.raises(EnvError, match=r"env\.python.*no interpreter 'no-such-python'"):
        load_source(config(tmp_path, {"env_id": "vf-digits", "python": "no-such-python"})).rows()


# --- verifiers.v1 (0.4, in .venv-verifiers: a worker process) ---------------------------------


def test_v1_trains_from_its_own_venv_with_its_reward_recorded(tmp_path):
    python = verifiers_python()
    cfg = config(tmp_path, {"env_id": "vf_v1_digits", "python": str(python),
                            "args": {"agent": {"harness": {"id": "null"}}}})
    assert train(cfg, log=lambda *_: None)["steps"] == 2
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 8 and all(r["state"] == "succeeded" for r in rollouts)
    for r in rollouts:  # the task's rewards of the reply the store holds, computed here
        (turn,) = r["turns"]
        text = turn["text"].strip()  # the reply as verifiers reads it (trace.last_reply)
        assert r["reward"] == pytest.approx(vf_digits.expected_reward(text))
        assert r["metrics"] == {"reward/has_digit": float(any(c.isdigit() for c in text)),
                                "reward/brevity": pytest.approx(1 - min(len(text), 40) / 40),
                                "length": float(len(text))}
        assert r["task"]["prompt"] == f"What is {r['task']['idx']} plus {r['task']['idx'] + 1}?"
    assert len({r["reward"] for r in rollouts}) > 1


def test_v1_plays_with_no_network_after_the_install_script(tmp_path, monkeypatch):
    """The null harness runs verifiers' chat program in a uv environment that each worker syncs
    (`uv sync --script`, with UV_OFFLINE=false: verifiers' own) at its first use; the install
    script pre-fetches it. No network here: uv's requests go to a closed port (proxies), the rest
    of uv is offline (UV_OFFLINE=1), and the gateway on this machine is reached directly."""
    python = verifiers_python()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        for var in (name, name.lower()):
            monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    monkeypatch.setenv("UV_OFFLINE", "1")
    env = load_source(config(tmp_path, {"env_id": "vf_v1_digits", "python": str(python),
                                        "args": {"agent": {"harness": {"id": "null"}}}}))
    try:
        with live_gateway(tmp_path) as gw:
            (r,) = gw.create(1)
            state, reward, text = asyncio.run(call_agent(env.agent, env.rows()[0], gateway_client(r), 60))
            assert state == "succeeded", f"{text}\n(without network: bash scripts/install-verifiers.sh)"
            (turn,) = gw.store.get_turns(r["rollout_id"])
            reply = gw.engine.tokenizer.decode(turn.response_ids, skip_special_tokens=True).strip()
            assert reward == pytest.approx(vf_digits.expected_reward(reply))
            gw.admin.close()
    finally:
        env.close()


def test_v1_two_agents_are_two_roles(tmp_path):
    python = verifiers_python()
    cfg = config(tmp_path, {"env_id": "vf_v1_duo", "python": str(python)}, "trainer.steps=1",
                 "rollout.tasks_per_step=1", roles={"train": ["solver"]})
    assert train(cfg, log=lambda *_: None)["steps"] == 1
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 2 and all(r["state"] == "succeeded" for r in rollouts)
    for r in rollouts:
        solver, checker = r["turns"]
        assert (solver["role"], checker["role"]) == ("solver", "checker")
        text = solver["text"].strip()
        assert r["reward"] == pytest.approx(vf_digits.expected_reward(text))  # the solver's: it trains
        assert r["metrics"]["solver/reward"] == pytest.approx(r["reward"])
        assert r["metrics"]["checker/reward"] == 0.0 and "solver/checker_yes" in r["metrics"]


def test_v1_failures_fail_the_rollout_and_a_hung_worker_is_killed(tmp_path, monkeypatch):
    python = verifiers_python()
    nope = load_source(config(tmp_path, {"env_id": "vf_v1_nope", "python": str(python)}))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    loading = pool.submit(nope.rows)  # meanwhile (its worker imports verifiers, then fails)
    env = load_source(config(tmp_path, {"env_id": "vf_v1_broken", "python": str(python), "api": "v1",
                                        "args": {"agent": {"harness": {"id": "null"}}}}))
    rows = {row["name"]: row for row in env.rows()}  # the taskset's task data, as rows
    with pytest.raises(EnvError, match=r"config key 'env'.*taskset 'vf_v1_nope' not found"):
        loading.result()
    pool.shutdown()
    assert rows["ok"] == {"idx": 0, "name": "ok", "prompt": "Question ok?"} and env.eval_rows() is None
    monkeypatch.setattr(verifiers_env, "CANCEL_GRACE_S", 1.0)
    with live_gateway(tmp_path) as gw:
        ok, raises, hangs, again = (gateway_client(r) for r in gw.create(4))
        assert asyncio.run(call_agent(env.agent, rows["ok"], ok, 60))[:2] == ("succeeded", 1.0)
        state, _, text = asyncio.run(call_agent(env.agent, rows["raise"], raises, 60))
        assert state == "failed" and "the v1 reward broke" in text  # the episode's error, kept
        worker = env._worker
        state, _, text = asyncio.run(call_agent(env.agent, rows["hang"], hangs, 8))
        assert state == "timed_out"
        deadline = time.time() + 15
        while worker.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert worker.proc.poll() is not None and "did not stop" in worker.dead  # killed
        with pytest.raises(ProcessLookupError):  # and nothing of its process group is left
            os.killpg(worker.proc.pid, 0)
        assert asyncio.run(call_agent(env.agent, rows["ok"], again, 60))[:2] == ("succeeded", 1.0)
        assert env._worker is not worker  # a fresh worker played it
        gw.admin.close()
    env.close()
