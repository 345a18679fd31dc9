"""The main job, end to end, small: the guess demo through a live gateway on loopback, agents on
the real openai SDK, turns in SQLite, rows, advantages, PPO updates, version bumps, checkpoints,
and a resume that continues the same run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from tracetrain.config import build_config
from tracetrain.trainer import Trainer, load_task, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "guess"


def small_config(run_dir: Path, steps: int, **extra):
    overrides = [
        "task=task.py",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=3", "warm_start.batch_size=8",
        "rollout.tasks_per_step=3", "rollout.n_per_task=4", "rollout.timeout_s=60",
        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.mini_batches=2",
        "optim.micro_batch_tokens=64",
        f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "trainer.seed=3",
        "trainer.eval_every=2", "trainer.eval_tasks=4",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return build_config({"task_args": {"high": 4, "max_turns": 3}}, overrides)


def ids_of_step(run_dir: Path, step: int) -> list[str]:
    db = sqlite3.connect(run_dir / "traces.db")
    ids = [r[0] for r in db.execute("SELECT rollout_id FROM rollouts WHERE group_id LIKE ?", (f"%-s{step}-t%",))]
    db.close()
    return ids


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_records_learns_checkpoints_and_resumes(tmp_path, capsys):
    # Weights before any update (same seed -> the same initial model and warm start).
    probe = Trainer(small_config(tmp_path / "probe", 1), load_task("task.py", EXAMPLE))
    initial = {k: v.clone() for k, v in probe.model.state_dict().items()}

    run = tmp_path / "run"
    out = train(small_config(run, 2), base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [0, 1]
    for m in rows:
        assert m["aggregate/n_rows"] > 0 and m["aggregate/n_rollouts"] > 0
        assert torch.isfinite(torch.tensor(m["loss"]))
        assert 0.0 <= m["reward_mean"] <= 1.0
    assert [m["model_version"] for m in rows] == [1, 2]  # one bump per step
    assert "eval/reward_mean" in rows[1]
    assert (run / "curve.png").stat().st_size > 1000 and out["steps"] == 2

    # Turns were recorded by the gateway with token ids and the engine's model version.
    db = sqlite3.connect(run / "traces.db")
    n_turns, versions = db.execute("SELECT count(*), group_concat(DISTINCT model_version) FROM turns").fetchone()
    assert n_turns >= 2 * 3 * 4
    assert set(map(int, versions.split(","))) >= {0, 1}
    db.close()

    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 2
    changed = [k for k, v in ck["model"].items() if not torch.equal(v, initial[k])]
    assert changed, "no weight changed after two RL steps"

    # `tracetrain inspect` follows one rollout of the run down the path of the data.
    from tracetrain.cli import main

    assert main(["inspect", str(run), "--rollout", ids_of_step(run, 1)[0]]) == 0
    shown = capsys.readouterr().out
    assert "turn 0 (model_version 1)" in shown and "advantage" in shown and "loss mass" in shown

    # Resume: two more steps continue the run (steps 2 and 3, versions 3 and 4).
    train(small_config(run, 4, **{"trainer.resume": "true"}), base_dir=EXAMPLE, log=lambda *_: None)
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [0, 1, 2, 3]
    assert [m["model_version"] for m in rows[2:]] == [3, 4]

    # Same seed, 4 steps straight: the same metrics as 2 + resume 2 (sampling is seeded per
    # rollout and turn, tasks are a function of (seed, step)).
    straight = tmp_path / "straight"
    train(small_config(straight, 4), base_dir=EXAMPLE, log=lambda *_: None)
    a, b = read_metrics(run), read_metrics(straight)
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"]
        assert x["aggregate/n_rows"] == y["aggregate/n_rows"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)
