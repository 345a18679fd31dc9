"""Tasks from files (tracetrain/agents/dataset.py): every format reads the same rows, bad rows are named,
the split holds out rows for good, and the epoch order is a function of (seed, step) alone; a
short real run draws its tasks from a file and a resumed run continues the order."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.agents.dataset import DatasetError, EpochOrder, TaskData, open_rows, split
from tracetrain.config import ConfigError

ROWS = [{"target": 1 + i % 8, "high": 8, "max_turns": 3, "note": f"row {i}"} for i in range(50)]


def write_all(tmp: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out = {"jsonl": tmp / "t.jsonl", "parquet": tmp / "t.parquet", "csv": tmp / "t.csv",
           "datasets": tmp / "saved"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 3 else "")
                                    for i, r in enumerate(ROWS)))
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, out["parquet"], row_group_size=7)
    pacsv.write_csv(table, out["csv"])
    datasets.Dataset.from_list(ROWS).save_to_disk(str(out["datasets"]))
    return out


def test_every_format_reads_the_same_rows(tmp_path):
    for kind, path in write_all(tmp_path).items():
        rows = open_rows(path)
        assert len(rows) == len(ROWS), kind
        assert [rows[i] for i in (0, 3, 4, 17, 49, 8)] == [ROWS[i] for i in (0, 3, 4, 17, 49, 8)], kind


def test_bad_files_and_rows_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"target": 1}\n\n{"target": 2\n')
    rows = open_rows(bad)
    assert len(rows) == 2 and rows[0] == {"target": 1}
    with pytest.raises(DatasetError, match=r"bad.jsonl: line 3 is not JSON"):
        rows[1]
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"target": 1, "high": 8}\n{"target": 2}\n')
    with pytest.raises(DatasetError, match=r"missing.jsonl: row 2 has no field 'high'"):
        TaskData(open_rows(missing), fields=["target", "high"])
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(DatasetError, match="unknown format '.txt'"):
        open_rows(tmp_path / "t.txt")
    with pytest.raises(DatasetError, match="no such file"):
        open_rows(tmp_path / "nope.jsonl")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DatasetError, match="not one written by datasets.save_to_disk"):
        open_rows(tmp_path / "folder")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="broken.parquet: not readable as parquet"):
        open_rows(tmp_path / "broken.parquet")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 9), seed=st.integers(0, 2**31),
       fraction=st.sampled_from([0, 0.1, 0.5]))
def test_each_epoch_deals_every_train_row_once_in_a_seeded_order(n, k, seed, fraction):
    train, held = split(n, fraction=fraction, seed=7)
    assert len(held) == round(fraction * n) and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(n))
    if len(train) == 0:
        with pytest.raises(DatasetError):
            EpochOrder(train, seed=seed)
        return
    order = EpochOrder(train, seed=seed)
    epochs = 3
    steps = -(-epochs * len(train) // k)
    dealt = [i for s in range(steps) for i in order.at(s, k)]
    for e in range(epochs):  # every train row exactly once per epoch, no held-out row ever
        assert sorted(dealt[e * len(train):(e + 1) * len(train)]) == sorted(train.tolist())
    # a function of (seed, step) alone: a fresh order (a resumed run) deals the same from any step
    fresh = EpochOrder(train, seed=seed)
    assert ([fresh.at(s, k) for s in reversed(range(steps))]
            == [order.at(s, k) for s in reversed(range(steps))])


def test_the_order_depends_on_the_seed_and_shuffle_off_keeps_file_order():
    a, b = EpochOrder(range(100), seed=1), EpochOrder(range(100), seed=2)
    assert a.at(0, 100) != b.at(0, 100) and sorted(a.at(0, 100)) == list(range(100))
    assert a.at(0, 100) != a.at(1, 100)  # a new order each epoch
    assert EpochOrder(range(10), seed=1, shuffle=False).at(1, 5) == [5, 6, 7, 8, 9]


def test_a_run_takes_its_tasks_from_a_file_and_a_resume_continues_the_order(tmp_path):
    from tracetrain.config import build_config
    from tracetrain.run.trainer import train

    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:20]))
    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"

    def config(run: Path, steps: int, **extra):
        return build_config({"task_args": {"high": 8, "max_turns": 3}}, [
            "task=task.py", f"data.train={data}", "data.eval_fraction=0.2",
            "data.fields=[target,high,max_turns]",
            "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
            "warm_start.steps=0", "rollout.tasks_per_step=3", "rollout.n_per_task=2",
            "optim.warmup_steps=0", f"trainer.steps={steps}", f"trainer.run_dir={run}", "trainer.seed=4",
            "trainer.eval_every=2", "trainer.eval_tasks=3", *[f"{k}={v}" for k, v in extra.items()]])

    def tasks_by_step(run: Path) -> dict[str, list[dict]]:
        """step ("s0", "eval0", ...) -> the task of each of its groups, in group order."""
        db = sqlite3.connect(run / "traces.db")
        groups = dict(db.execute("SELECT group_id, task FROM rollouts ORDER BY seq"))
        db.close()
        out: dict[str, list] = {}
        for group in sorted(groups, key=lambda g: int(g.rsplit("-t", 1)[1])):
            out.setdefault(group.rsplit("-t", 1)[0].split("-", 1)[1], []).append(json.loads(groups[group]))
        return out

    run = tmp_path / "run"
    train(config(run, 2), base_dir=guess, log=lambda *_: None)
    train(config(run, 4, **{"trainer.resume": "true"}), base_dir=guess, log=lambda *_: None)
    straight = tmp_path / "straight"
    train(config(straight, 4), base_dir=guess, log=lambda *_: None)
    got, want = tasks_by_step(run), tasks_by_step(straight)
    expected = TaskData(open_rows(data), eval_fraction=0.2, seed=4)
    for s in range(4):
        assert got[f"s{s}"] == want[f"s{s}"] == expected.train_tasks(s, 3)
    held = expected.eval_tasks(3)
    assert got["eval0"] == held and not any(t in held for s in range(4) for t in got[f"s{s}"])
    with pytest.raises(ConfigError, match="row 1 has no field 'nope'"):
        train(config(tmp_path / "bad", 1, **{"data.fields": "[nope]"}), base_dir=guess, log=lambda *_: None)


def test_on_verl_every_row_is_checked_before_ray_starts(tmp_path, monkeypatch):
    """backend verl takes its tasks from the same files (step_tasks with the run's TaskData); a bad
    row is named before Ray or any worker starts (verl's workers need GPUs: not run here)."""
    pytest.importorskip("verl")
    import ray

    from tracetrain.config import build_config
    from tracetrain.integrations.verl.trainer import train_verl

    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:5]))
    guess = Path(__file__).resolve().parents[2] / "examples" / "guess"
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(1))
    cfg = build_config({"task_args": {"high": 8}}, [
        "backend=verl", "task=task.py", f"data.train={data}", "data.fields=[target,nope]",
        f"trainer.run_dir={tmp_path / 'run'}"])
    assert cfg.backend == "verl" and cfg.data.train == str(data)  # accepted on verl
    with pytest.raises(ConfigError, match="row 1 has no field 'nope'"):
        train_verl(cfg, base_dir=guess, log=lambda *_: None)
    assert not started
