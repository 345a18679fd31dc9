"""TRL-style environment classes (env.environment_class): one instance per rollout, reset(**row),
the public methods as tools from their signatures and docstrings, the reward functions given the
instances. A run trains on one with tool calls exact across turns (the engine plugin
scripted_policy.py makes the calls, with the policy's own logprobs); an environment that raises,
hangs or scores NaN fails its own rollout while the step goes on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, hermes_call, live_gateway

from tracetrain.agents.runner import agent_client
from tracetrain.config import build_config
from tracetrain.envs import EnvError, load_object, load_source
from tracetrain.models.tiny import build_tokenizer
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ENVS = f"{SUPPORT / 'tool_envs.py'}"
PLUGIN = str(SUPPORT / "scripted_policy.py")


ENGINE = {"kind": "scripted_tools"}  # scripted_policy.py's engine


def helper(name: str):
    """An object of tool_envs.py as the run loads it (the same module object)."""
    return load_object(f"{ENVS}:{name}", "test")


@pytest.fixture(autouse=True)
def plugin_registered(clean_registries):
    """engine.kind scripted_tools (a config's plugin) for each test only: the tests that enumerate
    the registries never see it."""


def write_rows(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tmp_path: Path, env: dict, rows: list[dict], *overrides: str):
    return build_config({"plugins": [PLUGIN], "engine": ENGINE,
                         "env": {"kind": "environment_class", **env},
                         "data": {"train": write_rows(tmp_path, rows)}}, [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        f"rollout.tasks_per_step={len(rows)}", "rollout.n_per_task=2", "rollout.max_tokens=64",
        "rollout.timeout_s=20", "aggregate.max_prompt_length=1024",
        "aggregate.max_response_length=512", "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}",
        *overrides])


def stored(run_dir: Path) -> list:
    """(rollout record, its turns, its turn rewards) of every rollout the run's store holds."""
    store = SQLiteStore(run_dir / "traces.db")
    try:
        return [(r, store.get_turns(r.rollout_id), store.get_turn_rewards(r.rollout_id))
                for r in store.list_rollouts(limit=1000)]
    finally:
        store.close()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_classes_tools_are_its_public_methods_with_their_schemas(tmp_path):
    from tracetrain.envs.environment_class import tool_methods, tool_schemas

    counter = helper("Counter")()
    assert list(tool_methods(counter)) == ["add"]  # not reset, close, nor _private
    (schema,) = tool_schemas(counter)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add a number to the counter."
    assert schema["function"]["parameters"]["properties"] == {
        "n": {"type": "integer", "description": "the number to add"}}
    env = load_source(config(tmp_path, {"factory": f"{ENVS}:Undocumented", "reward_funcs": []},
                             [{"prompt": "x"}]))
    row = {"prompt": "x"}
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        with pytest.raises(EnvError, match=r"Undocumented.act has no schema"):
            asyncio.run(env.agent(row, agent_client(r, {"model": "policy"}, 0)))
        gw.admin.close()


def test_a_rollout_plays_the_convention_through_the_gateway(tmp_path):
    """reset's text is appended to the prompt; a tool error is told to the model; the reward
    functions' sum (None left out) is the reward; the instance is closed."""
    closed_list = helper("CLOSED")
    env = load_source(config(tmp_path, {"factory": f"{ENVS}:Counter", "system_prompt": "Be brief.",
                                        "reward_funcs": [f"{ENVS}:closeness", f"{ENVS}:called"]},
                             [{"prompt": "Count.", "target": 5}]))
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        gw.engine.say(hermes_call("add", {"n": 2}))
        gw.engine.say(hermes_call("add", {"m": 1}) + hermes_call("nope", {}))
        gw.engine.say("Done.")
        client = agent_client(r, {"model": "policy", "max_tokens": 64}, 0)
        closed = len(closed_list)
        reward = asyncio.run(env.agent({"prompt": "Count.", "target": 5}, client))
        assert reward == pytest.approx(-0.3 + 0.1)  # |5 - 2| / 10 off, and a tool was called
        assert closed_list[closed:] == [2]
        (event,) = gw.store.list_events(r["rollout_id"], kind="metrics")  # each source's term
        # and the tool errors: add(m=1) raised, nope is no tool (add(n=2) answered)
        assert event.payload == pytest.approx({"closeness": -0.3, "called": 0.1, "tool_errors": 2})
        turns = gw.store.get_turns(r["rollout_id"])
        assert [t.context for t in turns] == ["rendered", "exact", "exact"]
        last = gw.engine.tokenizer.decode(turns[-1].prompt_ids)
        assert "<|im_start|>system\nBe brief.\n\n# Tools" in last
        assert "<|im_start|>user\nCount. Reach 5.<|im_end|>" in last
        assert "<|im_start|>tool\ntotal 2<|im_end|>" in last
        assert "{'error': \"Counter.add() got an unexpected keyword argument 'm'\"}" in last
        assert "{'error': 'Tool nope not found.'}" in last
        gw.admin.close()


def test_get_reward_and_done_end_and_score_the_rollout(tmp_path):
    env = load_source(config(tmp_path, {"factory": f"{ENVS}:Owned"}, [{"prompt": "Go."}]))
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        gw.engine.say(hermes_call("poke", {}))  # done after it: no second call
        client = agent_client(r, {"model": "policy"}, 0)
        assert asyncio.run(env.agent({"prompt": "Go."}, client)) == 1.0
        assert len(gw.store.get_turns(r["rollout_id"])) == 1
        gw.admin.close()


def test_trains_with_tool_calls_exact_across_turns(tmp_path):
    rows = [{"prompt": "Count.", "target": 4}, {"prompt": "Count.", "target": 7}]
    held = tmp_path / "held.jsonl"  # the eval passes' row
    held.write_text(json.dumps({"prompt": "Count.", "target": 0}) + "\n")
    cfg = config(tmp_path, {"factory": f"{ENVS}:Counter", "reward_funcs": [f"{ENVS}:closeness"]}, rows,
                 f"data.eval={held}", "trainer.eval_every=2", "trainer.eval_tasks=1")
    out = train(cfg, log=lambda *_: None)
    assert out["steps"] == 2 and out["failed_rollouts"] == 0
    rollouts = [r for r in stored(tmp_path / "run") if "-eval" not in r[0].rollout_id]
    tok = build_tokenizer()
    assert len(rollouts) == 2 * 2 * 2
    for record, turns, _ in rollouts:
        assert record.state.value == "succeeded", record.error
        assert len(turns) == 3  # two tool calls, then the answer
        assert [t.context for t in turns[1:]] == ["exact", "exact"]
        calls = [json.loads(tok.decode(t.response_ids, skip_special_tokens=True)
                            .removeprefix("<tool_call>").removesuffix("</tool_call>")) for t in turns[:2]]
        assert [c["name"] for c in calls] == ["add", "add"]
        added = sum(c["arguments"]["n"] for c in calls)  # the reward function's score of them
        assert record.reward == pytest.approx(-abs(record.task["target"] - added) / 10)
        assert all(t.response_logprobs and max(t.response_logprobs) < 0 for t in turns)
    steps = metrics(tmp_path / "run")
    for m in steps:  # the reward function's mean over the step's rollouts (its only source)
        assert m["env/closeness"] == pytest.approx(m["reward_mean"])
        # every rollout called `add` twice, each call parsed and answered (tools/*: rows/tool_metrics.py)
        assert {k: v for k, v in m.items() if k.startswith("tools/")} == {
            "tools/calls_per_rollout": 2.0, "tools/rollouts_with_call": 1.0,
            "tools/parse_failures": 0, "tools/unknown": 0, "tools/errors": 0}
    # the eval passes (before step 0, after step 1) count their own calls: eval/initial_tools/*, eval/tools/*
    for prefix, m in (("eval/initial_", steps[0]), ("eval/", steps[1])):
        assert {k: v for k, v in m.items() if k.startswith(prefix + "tools/")} == {
            prefix + "tools/calls_per_rollout": 2.0, prefix + "tools/rollouts_with_call": 1.0,
            prefix + "tools/parse_failures": 0, prefix + "tools/unknown": 0, prefix + "tools/errors": 0}
    assert "eval/tools/calls_per_rollout" not in steps[0]
    assert [m["aggregate/breaks/total"] for m in steps] == [0, 0]
    assert [m["aggregate/n_rollouts"] for m in steps] == [4, 4]
    assert any(m["grad_norm"] > 0 for m in steps)  # a real update from the rewards' spread


def test_an_environment_that_raises_hangs_or_scores_nan_fails_its_rollout_only(tmp_path):
    release = helper("RELEASE")
    rows = [{"prompt": "Count.", "target": 4, "mode": mode} for mode in ("ok", "raise", "hang", "nan")]
    cfg = config(tmp_path, {"factory": f"{ENVS}:Counter", "reward_funcs": [f"{ENVS}:closeness"]},
                 rows, "rollout.timeout_s=6")  # an ok rollout takes 1-3 s on a loaded machine
    try:
        out = train(cfg, log=lambda *_: None)
    finally:
        release.set()
    assert out["steps"] == 2
    by_mode: dict[str, list] = {}
    for record, _, _ in stored(tmp_path / "run"):
        by_mode.setdefault(record.task["mode"], []).append(record)
    assert {m: len(rs) for m, rs in by_mode.items()} == {"ok": 4, "raise": 4, "hang": 4, "nan": 4}
    for r in by_mode["ok"]:
        assert r.state.value == "succeeded" and r.reward is not None
    for r in by_mode["raise"]:
        assert r.state.value == "failed" and "RuntimeError: the counter environment broke in reset" in r.error
        assert "Traceback" in r.error
    for r in by_mode["hang"]:
        assert r.state.value == "timed_out" and "did not finish within 6.0 s" in r.error
    for r in by_mode["nan"]:
        assert r.state.value == "failed" and "reward function closeness returned nan" in r.error


def test_eval_reports_the_tool_use_of_its_tries(tmp_path):
    """`tracetrain eval`'s summary holds the tries' tools/* (run/step.py tools_metrics): each try
    calls `add` twice, every call parsed and answered."""
    from tracetrain.agents.tasks import open_task_data
    from tracetrain.run.evaluate import evaluate

    rows = [{"prompt": "Count.", "target": t} for t in (3, 4, 5, 6)]
    cfg = config(tmp_path, {"factory": f"{ENVS}:Counter", "reward_funcs": [f"{ENVS}:closeness"]}, rows,
                 "data.eval_fraction=0.5")
    env = load_source(cfg)
    summary, _ = asyncio.run(evaluate(cfg, env, open_task_data(cfg, None, env), k=2, n_tasks=2,
                                      log=lambda *_: None))
    assert summary["tries"] == 4 and summary["failed"] == 0
    assert {k: v for k, v in summary.items() if k.startswith("tools/")} == {
        "tools/calls_per_rollout": 2.0, "tools/rollouts_with_call": 1.0,
        "tools/parse_failures": 0, "tools/unknown": 0, "tools/errors": 0}
