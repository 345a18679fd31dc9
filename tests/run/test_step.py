"""The shared step (tracetrain/run/step.py): the verl backend runs the same stages as the embedded
trainer. verl's servers and actor need a GPU, so its step runs here with what stands in for them
only: a checkpoint manager that records the sync calls, an engine behind the real gateway, and an
`update` that keeps what the actor would have been given."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gateway_fixtures import FakeEngine
from test_train_e2e import small_config

from tracetrain.agents.runner import GatewayClient, agent_http_client
from tracetrain.agents.tasks import load_task, resolve_agent
from tracetrain.gateway.app import create_app
from tracetrain.gateway.inprocess import serve_in_loop
from tracetrain.integrations.verl.trainer import VerlRun
from tracetrain.run.failures import FailedSteps
from tracetrain.run.step import build_rows, rollout_specs
from tracetrain.store import SQLiteStore
from tracetrain.types import RunFailed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "guess"


class RecordingCheckpointManager:
    """What verl's checkpoint manager is asked: push the weights of a step, free the servers."""

    def __init__(self):
        self.calls: list[tuple] = []

    def update_weights(self, step: int) -> None:
        self.calls.append(("update_weights", step))

    def sleep_replicas(self) -> None:
        self.calls.append(("sleep_replicas",))


def verl_run(tmp_path: Path, engine: FakeEngine, data=None) -> VerlRun:
    cfg = small_config(tmp_path / "run", 2)
    run = VerlRun.__new__(VerlRun)  # verl's workers are not started: __init__ needs a GPU cluster
    run.cfg, run.task, run.step, run.nonce = cfg, load_task("task.py", EXAMPLE), 0, "n0"
    run.data = data
    run.tokenizer = engine.tokenizer
    run.trainer = SimpleNamespace(checkpoint_manager=RecordingCheckpointManager())
    run.agent = resolve_agent(run.task, cfg.agent)
    run.store = SQLiteStore(tmp_path / "traces.db")
    run.failures, run.log, run.updates = FailedSteps(cfg.trainer.max_failed_steps), print, []

    def update(batch, adv):
        run.updates.append((batch, adv))
        return {"loss": 0.5, "grad_norm": 1.0}

    run.update = update
    return run


def two_steps(run: VerlRun, engine: FakeEngine) -> list[dict]:
    engines = {"verl-0": engine}

    async def go():
        app = create_app(run.store, engines, admin_key="k" * 24)
        async with serve_in_loop(app) as url, agent_http_client(8) as http:
            gateway = GatewayClient(url, "k" * 24)
            try:
                return [await run.train_step(gateway, engines, http) for _ in range(2)]
            finally:
                await gateway.aclose()

    return asyncio.run(go())


@pytest.mark.slow
def test_verls_step_is_the_shared_step(tmp_path):
    """Two steps on the verl backend: weights pushed before each collect, servers put to sleep
    after it; the actor is given exactly the rows and advantages `step.rows` makes of the step's
    rollouts; the metrics are the shared ones; the model version goes up by one per step."""
    engine = FakeEngine()
    run = verl_run(tmp_path, engine)
    try:
        history = two_steps(run, engine)
        assert run.trainer.checkpoint_manager.calls == [
            ("update_weights", 0), ("sleep_replicas",), ("update_weights", 1), ("sleep_replicas",)]
        assert [m["model_version"] for m in history] == [1, 2] and run.step == 2
        cfg = run.cfg
        n = cfg.rollout.tasks_per_step * cfg.rollout.n_per_task
        for step, (m, (batch, adv)) in enumerate(zip(history, run.updates, strict=True)):
            ids = [r.rollout_id for r in run.store.list_rollouts(limit=1000)
                   if r.group_id.startswith(f"n0-s{step}-")]
            assert len(ids) == n and batch.n_rows >= 1
            results = [SimpleNamespace(rollout_id=i, state=run.store.get_rollout(i).state.value,
                                       reward=run.store.get_rollout(i).reward) for i in ids]
            again = build_rows(run.store, results, cfg, run.tokenizer, step)
            assert torch.equal(again.batch.input_ids, batch.input_ids)
            assert torch.equal(again.advantages, adv)
            for key in ("reward_mean", "n_failed", "aggregate/n_rows", "context/exact",
                        "advantage/n_groups", "time/rows_s", "rows_per_rollout", "loss"):
                assert key in m, key
            assert m["aggregate/n_rows"] == batch.n_rows
    finally:
        run.store.close()


def test_verls_step_stops_the_run_before_training_when_every_rollout_failed(tmp_path, capsys):
    """run/failures.py on the verl backend: step 0's agents all raise; the step says so and
    raises RunFailed with the first error; the actor is given nothing."""
    engine = FakeEngine()
    run = verl_run(tmp_path, engine)

    async def tool_down(task, client):
        raise ConnectionError("the tool server is down")

    run.agent = tool_down
    n = run.cfg.rollout.tasks_per_step * run.cfg.rollout.n_per_task
    try:
        with pytest.raises(RunFailed, match=rf"^every rollout of step 0 failed \({n} failed\): "
                                            r"ConnectionError: the tool server is down$"):
            two_steps(run, engine)
    finally:
        run.store.close()
    assert run.updates == [] and run.step == 0
    assert f"step    0 | fail {n}+0 | stopped: every rollout of step 0 failed" in capsys.readouterr().out


def test_rollout_specs_deal_groups_to_engines_and_omit_the_engine_without_them():
    specs = rollout_specs(["a", "b"], 3, "p")
    assert [s["group_id"] for s in specs] == ["p-t0"] * 3 + ["p-t1"] * 3
    assert "engine" not in specs[0] and len({s["rollout_id"] for s in specs}) == 6
    dealt = rollout_specs(["a", "b", "c"], 1, "p", ["e0", "e1"])
    assert [s["engine"] for s in dealt] == ["e0", "e1", "e0"]


def test_verls_step_takes_its_tasks_from_the_runs_data_file(tmp_path):
    """data.train on the verl backend: each step's groups play the rows the embedded trainer's
    step would (TaskData's epoch order), one group per row."""
    import json
    import sqlite3

    from tracetrain.agents.dataset import TaskData, open_rows

    rows_file = tmp_path / "games.jsonl"
    rows_file.write_text("".join(json.dumps({"target": 1 + j % 8, "high": 8, "max_turns": 2}) + "\n"
                                 for j in range(7)))
    data = TaskData(open_rows(rows_file), seed=3)
    engine = FakeEngine()
    run = verl_run(tmp_path, engine, data)
    try:
        two_steps(run, engine)
    finally:
        run.store.close()
    db = sqlite3.connect(tmp_path / "traces.db")
    groups = dict(db.execute("SELECT group_id, task FROM rollouts"))
    db.close()
    G = run.cfg.rollout.tasks_per_step
    for step in range(2):
        played = [json.loads(groups[f"n0-s{step}-t{j}"]) for j in range(G)]
        assert played == data.train_tasks(step, G)


def test_env_metrics_average_each_name_over_the_rollouts_that_reported_it():
    """r1 reports acc twice (its last value counts) and fmt; r2 acc only, with a NaN and a text
    that are left out; r3 reports nothing. env/acc = (1 + 0) / 2, env/fmt = 0.5 / 1."""
    from tracetrain.run.step import env_metrics

    events = {"r1": [{"acc": 0.0, "fmt": 0.5}, {"acc": 1.0}],
              "r2": [{"acc": 0.0, "len": float("nan"), "note": "x"}], "r3": []}
    store = SimpleNamespace(list_events=lambda rid, kind=None: [
        SimpleNamespace(payload=p) for p in events[rid] if kind == "metrics"])
    assert env_metrics(store, ["r1", "r2", "r3"]) == {"env/acc": 0.5, "env/fmt": 0.5}
    assert env_metrics(store, ["r3"]) == {}


def test_tools_metrics_count_the_tool_errors_reported_by_rollouts_offered_tools():
    """a reports tool_errors 1 then 2 (its last counts), b reports none, c was never offered tools
    (its 7 is left out): tools/errors = 2; a made 2 calls, b none (1 unparsed)."""
    from tracetrain.run.step import env_metrics, rollout_reports, tools_metrics
    from tracetrain.types import Rollout, ToolStats, Turn

    events = {"a": [{"tool_errors": 1, "acc": 1.0}, {"tool_errors": 2}], "b": [],
              "c": [{"tool_errors": 7}]}
    store = SimpleNamespace(list_events=lambda rid, kind=None: [
        SimpleNamespace(payload=p) for p in events[rid] if kind == "metrics"])
    rollouts = [Rollout("a", "g", [Turn([1], [2], tools=ToolStats(2, 0, 0))]),
                Rollout("b", "g", [Turn([1], [2], tools=ToolStats(0, 1, 0))]),
                Rollout("c", "g", [Turn([1], [2])])]
    assert tools_metrics(store, rollouts) == {
        "tools/calls_per_rollout": 1.0, "tools/rollouts_with_call": 0.5,
        "tools/parse_failures": 1, "tools/unknown": 0, "tools/errors": 2}
    reports = rollout_reports(store, ["a", "b", "c"])
    assert reports == {"a": {"tool_errors": 2.0, "acc": 1.0}, "b": {}, "c": {"tool_errors": 7.0}}
    assert env_metrics(store, [], reports) == {"env/acc": 1.0, "env/tool_errors": 4.5}
