"""trainer.report_to (run/trackers.py), against the real packages, offline: each tracker gets
every step's metrics, the run's config and the eval passes' sample rollouts, read back with the
tracker's own reader (TensorBoard's event files, trackio's and MLflow's local stores, wandb's
offline run file); one that cannot start or fails mid-run is named once and training goes on."""

from __future__ import annotations

import json
import sys

import pytest
import wandb_records
from test_train_e2e import EXAMPLE, small_config

from tracetrain.config import ConfigError, build_config
from tracetrain.run.trackers import open_trackers

ALL = ["tensorboard", "wandb", "trackio", "mlflow"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker's store under tmp_path (MLflow's artifacts too: ./mlruns), nothing sent
    anywhere."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr("trackio.TRACKIO_DIR", tmp_path / "trackio", raising=False)
    import trackio.sqlite_storage as storage
    import trackio.utils as utils

    monkeypatch.setattr(utils, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    monkeypatch.setattr(storage, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    return tmp_path


def tensorboard_scalars(run_dir, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def tensorboard_texts(run_dir, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def trackio_logs(run_name: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs("tracetrain", run_name)


def mlflow_run(run_name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.get_experiment_by_name("tracetrain")
    (run,) = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'")
    return client, run


def eval_pass(run_dir, marker: str) -> list[tuple[dict, str, float]]:
    """(task, its last turn's text, reward) of each rollout of one eval pass, from traces.db."""
    from tracetrain.models.tiny import build_tokenizer
    from tracetrain.store import SQLiteStore

    tok = build_tokenizer()
    with SQLiteStore(run_dir / "traces.db", read_only=True) as store:
        out = [(r.task, tok.decode(list(store.get_turns(r.rollout_id)[-1].response_ids),
                                   skip_special_tokens=True), r.reward)
               for r in store.list_rollouts(limit=1000) if marker in r.rollout_id]
    assert len(out) == 3
    return out


def test_the_old_booleans_are_refused_naming_report_to():
    for old in ("tensorboard", "wandb"):
        with pytest.raises(ConfigError, match=rf"trainer\.{old} .*report_to: \[{old}\]"):
            build_config({}, [f"trainer.{old}=true"])
    with pytest.raises(ConfigError, match="trainer.report_to"):
        build_config({}, ["trainer.report_to=[comet]"])


@pytest.mark.slow
def test_a_run_reports_every_step_its_config_and_eval_samples_to_each_tracker(offline):
    """A 2-step demo run with an eval pass before and after each step, all four trackers on."""
    from tracetrain.agents.tasks import load_task
    from tracetrain.run.trainer import train

    run_dir = offline / "guess-run"
    cfg = small_config(run_dir, 2, **{"trainer.eval_every": 1, "trainer.eval_tasks": 3,
                                      "trainer.report_to": json.dumps(ALL)})
    said: list[str] = []
    train(cfg, base_dir=EXAMPLE, log=said.append)
    assert load_task("task.py", EXAMPLE)  # (the config's task, as the run loaded it)
    assert not [s for s in said if "tracker" in s], said  # every tracker started and stayed
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every number of every step (an int or float; not the step, nor the lists)
    series: dict[str, list[tuple[int, float]]] = {}
    for m in steps:
        for k, v in m.items():
            if type(v) in (int, float) and k != "step":
                series.setdefault(k, []).append((m["step"], v))
    assert {"loss", "reward_mean", "eval/reward_mean", "eval/initial_reward_mean", "lr"} <= set(series)
    assert len({v for _, v in series["time/elapsed_s"]}) == 2  # (a number that differs by step)

    def same(got: list[tuple[int, float]], k: str, rel: float = 1e-12) -> None:
        assert [s for s, _ in got] == [s for s, _ in series[k]], k
        assert [v for _, v in got] == pytest.approx([v for _, v in series[k]], rel=rel, abs=1e-30), k

    for k in series:  # TensorBoard keeps float32
        same(tensorboard_scalars(run_dir, k), k, rel=1e-6)
    (config_text,) = tensorboard_texts(run_dir, "config")
    assert f'"run_dir": "{run_dir}"' in config_text[1]
    samples = tensorboard_texts(run_dir, "eval/samples")
    assert [s for s, _ in samples] == [0, 1] and samples[0][1].startswith("| task | reply | reward |")
    assert len(samples[0][1].splitlines()) == 2 + 3  # header, rule, one row per eval task

    logs = trackio_logs(run_dir.name)
    by_step = {}
    for entry in logs:
        by_step.setdefault(entry["step"], {}).update(entry)
    for k in series:
        same([(s, by_step[s][k]) for s in sorted(by_step) if k in by_step[s]], k)
    table = by_step[1]["eval/samples"]
    assert table["_type"] == "trackio.table"
    # the eval pass after step 1: its rollouts in traces.db, their tasks, last replies and rewards
    assert [(json.loads(r["task"]), r["reply"], r["reward"]) for r in table["_value"]] == eval_pass(
        run_dir, "-eval2-")
    assert by_step[0]["eval/initial_samples"]["_type"] == "trackio.table"

    client, run = mlflow_run(run_dir.name)
    for k in series:
        same([(h.step, h.value) for h in client.get_metric_history(run.info.run_id, k)], k)
    assert run.data.params["trainer.run_dir"] == json.dumps(str(run_dir))
    assert run.info.status == "FINISHED"
    files = {f.path for f in client.list_artifacts(run.info.run_id, "eval")}
    assert {"eval/samples_step_0.json", "eval/samples_step_1.json",
            "eval/initial_samples_step_0.json"} <= files

    logged = wandb_records.history(run_dir)
    for k in series:
        same([(h["_step"], h[k]) for h in logged if k in h], k)
    assert any(h.get("eval/samples/_type") == "table-file" for h in logged)
    assert wandb_records.config(run_dir)["trainer"]["run_dir"] == str(run_dir)


def test_a_tracker_that_cannot_start_or_fails_later_is_named_once_and_the_others_go_on(
        offline, monkeypatch):
    """mlflow's server down: left out at the start, named; trackio missing: named with the
    install line; tensorboard's store removed mid-run... here MLflow's run deleted after step 0:
    warned once, the other trackers get every step."""
    run_dir = offline / "r"
    said: list[str] = []
    cfg = build_config({}, [f"trainer.run_dir={run_dir}", "trainer.report_to=[tensorboard,trackio,mlflow]"])
    monkeypatch.setitem(sys.modules, "trackio", None)  # not installed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with open_trackers(cfg, run_dir, said.append) as trackers:
        assert sorted(trackers.started) == ["tensorboard"]
        trackers.log({"step": 0, "loss": 1.0})
    assert len(said) == 2
    assert "tracker 'trackio' left out: its package is not installed" in said[0]
    assert "pip install 'tracetrain[trackers]'" in said[0]
    assert "tracker 'mlflow' left out: it did not start" in said[1] and "127.0.0.1:1" in said[1]

    monkeypatch.delitem(sys.modules, "trackio")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{offline / 'mlflow.db'}")
    said.clear()
    cfg = build_config({}, [f"trainer.run_dir={offline / 'r2'}", "trainer.report_to=[mlflow,tensorboard]"])
    with open_trackers(cfg, offline / "r2", said.append) as trackers:
        trackers.log({"step": 0, "loss": 3.0, "collect/groups": ["a"]})
        client, run = mlflow_run("r2")
        client.delete_run(run.info.run_id)  # MLflow refuses to log to a deleted run
        for step in (1, 2):
            trackers.log({"step": step, "loss": 3.0 - step})
        assert list(trackers.started) == ["tensorboard"]
    assert len(said) == 1 and "tracker 'mlflow' left out from here on: logging step 1 failed" in said[0]
    assert tensorboard_scalars(offline / "r2", "loss") == [(0, 3.0), (1, 2.0), (2, 1.0)]
