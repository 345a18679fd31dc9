"""reasoning-gym as a task source, against the real package: the rows are the dataset's own
entries, held out as `data` holds out a file's rows, scored by the dataset's own `score_answer`;
a run trains on them wherever its agents run (in process, in agent worker processes, on Ray)."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest
import reasoning_gym
from gateway_fixtures import ScriptedEngine, live_gateway

from tracetrain.agents.tasks import open_task_data
from tracetrain.config import ConfigError, build_config
from tracetrain.envs import EnvError, load_source
from tracetrain.models.tiny import build_tokenizer
from tracetrain.run.trainer import train
from tracetrain.store import SQLiteStore

ARITH = {"dataset": "basic_arithmetic", "size": 40, "seed": 7,
         "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def config(tmp_path: Path, env: dict, *overrides: str, data: dict | None = None):
    return build_config({"env": {"kind": "reasoning_gym", **env}, "data": data or {}}, [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "rollout.tasks_per_step=2", "rollout.n_per_task=2", "rollout.max_tokens=6",
        "rollout.timeout_s=60", "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}",
        *overrides])


def test_rows_are_the_datasets_entries_and_its_oracle_scores_one(tmp_path):
    cfg = config(tmp_path, ARITH)
    env = load_source(cfg)
    rows = env.rows()
    direct = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=7, min_terms=2,
                                          max_terms=2, min_digits=1, max_digits=1)
    assert len(rows) == 40 and [rows[i] for i in range(40)] == [dict(direct[i]) for i in range(40)]
    for i in range(40):
        row = rows[i]
        assert env.dataset.score_answer(row["answer"], row) == 1.0  # the dataset's oracle
        assert env.dataset.score_answer(str(int(row["answer"]) + 1), row) == 0.0
        assert env.dataset.score_answer(None, row) == 0.0
    # a worker process (or a Ray worker) rebuilds the environment from its config: the same rows
    again = pickle.loads(pickle.dumps(env))
    assert "dataset" not in again.__dict__  # nothing generated travels; it is made again there
    assert [again.rows()[i] for i in range(40)] == [rows[i] for i in range(40)]


def test_held_out_rows_are_split_as_a_files_and_never_trained(tmp_path):
    cfg = config(tmp_path, ARITH, "rollout.tasks_per_step=5", data={"eval_fraction": 0.25, "split_seed": 3})
    env = load_source(cfg)
    data = open_task_data(cfg, None, env)
    held = data.eval_tasks(100)
    assert len(held) == 10
    trained = [t for step in range(6) for t in data.train_tasks(step, 5)]  # 30 tasks: one epoch
    key = lambda t: json.dumps(t, sort_keys=True)  # noqa: E731
    assert sorted(map(key, trained)) == sorted(key(env.rows()[i]) for i in data.order.indices)
    assert not {key(t) for t in held} & {key(t) for t in trained}
    assert data.eval_tasks(100) == held  # the same held-out rows every pass


def test_a_composite_draws_rows_from_each_dataset_by_weight(tmp_path):
    env = load_source(config(tmp_path, {"size": 200, "datasets": {
        "basic_arithmetic": {"weight": 1.0}, "chain_sum": {"weight": 3.0, "config": {"max_terms": 3}}}}))
    rows = env.rows()
    sources = [rows[i]["metadata"]["source_dataset"] for i in range(200)]
    assert set(sources) == {"basic_arithmetic", "chain_sum"}
    assert 0.6 < sources.count("chain_sum") / 200 < 0.9  # weight 3 of 4
    for i in range(0, 200, 17):
        assert env.dataset.score_answer(rows[i]["answer"], rows[i]) == 1.0


@pytest.mark.parametrize("reply, expected", [
    ("Let me think.\n<answer>{answer}</answer>", 1.0),      # the dataset's own answer format
    ("<answer>{wrong}</answer>", 0.0),
    ("{answer}", 0.0),                                       # no tags: no answer read
])
def test_the_agent_plays_through_the_gateway_and_scores_with_the_dataset(tmp_path, reply, expected):
    env = load_source(config(tmp_path, ARITH))
    row = env.rows()[0]
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        gw.engine.say(reply.format(answer=row["answer"], wrong=int(row["answer"]) + 1))
        client = {"base_url": r["base_url"], "api_key": r["api_key"], "model": "policy",
                  "max_tokens": 64, "temperature": 1.0}
        assert asyncio.run(env.agent(row, client)) == expected
        (turn,) = gw.store.get_turns(r["rollout_id"])
        prompt = gw.engine.tokenizer.decode(turn.prompt_ids)
        assert row["question"] in prompt
        assert "<answer>answer here</answer>" in prompt  # reasoning-gym's default system prompt
        gw.admin.close()


def test_bad_names_and_options_are_errors_naming_the_key(tmp_path):
    with pytest.raises(EnvError, match=r"'env\.dataset'.*no reasoning-gym dataset 'basic_arithmetc'"):
        load_source(config(tmp_path, {**ARITH, "dataset": "basic_arithmetc", "config": {}})).rows()
    with pytest.raises(EnvError, match=r"config key 'env'.*TypeError"):
        load_source(config(tmp_path, {**ARITH, "config": {"no_such_option": 1}})).rows()
    with pytest.raises(ConfigError, match=r"'env\.dataset'.*`dataset`.*`datasets`"):
        config(tmp_path, {"size": 10})
    with pytest.raises(ConfigError,
                       match=r"data.train / data.eval: env.kind reasoning_gym brings its own rows"):
        config(tmp_path, ARITH, data={"train": "x.jsonl"})
    with pytest.raises(ConfigError, match=r"'task': not with env \(kind reasoning_gym"):
        config(tmp_path, ARITH, "task=examples/calculator/task.py")


def recorded(run_dir: Path) -> list[tuple[str, float | None, str, dict]]:
    """(state, reward, the reply's text, task) of every trained rollout the store holds."""
    tok = build_tokenizer()  # the tiny model's tokenizer, as the run built it
    store = SQLiteStore(run_dir / "traces.db")
    try:
        out = []
        for r in store.list_rollouts(limit=1000):
            if r.group_id.startswith("eval"):
                continue
            (turn,) = store.get_turns(r.rollout_id)
            text = tok.decode(turn.response_ids, skip_special_tokens=True)
            out.append((r.state.value, r.reward, text, r.task))
        return out
    finally:
        store.close()


@pytest.mark.parametrize("where", ["in-process", "agent-workers"])
def test_trains_with_the_datasets_reward_recorded(tmp_path, where):
    cfg = config(tmp_path, {**ARITH, "answer": "whole"},
                 *(["rollout.agent_workers=1"] if where == "agent-workers" else []),
                 data={"eval_fraction": 0.25})
    out = train(cfg, log=lambda *_: None)
    assert out["steps"] == 2
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 2 * 2 * 2 and all(state == "succeeded" for state, *_ in rollouts)
    scorer = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)
    for _, reward, text, task in rollouts:  # the reward is the dataset's score of the reply
        assert reward == scorer.score_answer(text.strip() or None, task)


@pytest.mark.slow
def test_trains_with_agents_on_ray(tmp_path):
    """`runner: ray`: the environment travels to the Ray workers as its config section and is
    rebuilt there; one step's rollouts all succeed with the dataset's reward."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        train(config(tmp_path, {**ARITH, "answer": "whole"}, "runner=ray", "trainer.steps=1"),
              log=lambda *_: None)
    finally:
        ray.shutdown()
    rollouts = recorded(tmp_path / "run")
    assert len(rollouts) == 4 and all(state == "succeeded" for state, *_ in rollouts)
    scorer = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)
    for _, reward, text, task in rollouts:
        assert reward == scorer.score_answer(text.strip() or None, task)


@pytest.mark.parametrize("answer, reply, expected", [
    ("last_number", "The answer to this problem is {answer}.", 1.0),
    ("last_number", "It is {answer}, or maybe {wrong}.", 0.0),   # the last number counts
    ("last_line", "Let me see.\n{answer}\n", 1.0),
    ("whole", " {answer} ", 1.0),
    ("whole", "{wrong}", 0.0),
])
def test_each_answer_extraction_reads_the_reply_as_it_says(tmp_path, answer, reply, expected):
    env = load_source(config(tmp_path, {**ARITH, "answer": answer}))
    row = env.rows()[1]
    text = reply.format(answer=row["answer"], wrong=int(row["answer"]) + 1)
    assert env.dataset.score_answer(env.extract(text), row) == expected
