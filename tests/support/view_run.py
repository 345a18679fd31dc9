"""A short real training run for the viewer's tests (tests/support/view_task.py's agents: plain, hostile,
rewriting, failing) and ways to read its store directly."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tracetrain.config import build_config

TESTS = Path(__file__).resolve().parent


def view_config(run_dir: Path, steps: int = 2, **extra):
    overrides = [
        "task=view_task.py",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "warm_start.steps=0", "rollout.tasks_per_step=4", "rollout.n_per_task=2",
        "rollout.timeout_s=60", "optim.lr=1e-3", "optim.warmup_steps=0", "optim.mini_batches=2",
        f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "trainer.seed=5",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return build_config({}, overrides)


def make_run(run: Path, steps: int = 2) -> Path:
    from tracetrain.run.trainer import train

    train(view_config(run, steps), base_dir=TESTS, log=lambda *_: None)
    return run


def store_rows(run_dir: Path, sql: str, *args) -> list[tuple]:
    db = sqlite3.connect(run_dir / "traces.db")
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def step_ids(run_dir: Path, step: int) -> list[tuple[str, str, float | None, str | None]]:
    """(rollout id, state, reward, error) of a step's rollouts, in order."""
    return store_rows(run_dir, "SELECT rollout_id, state, COALESCE(reward_override, reward_event),"
                      " error FROM rollouts WHERE group_id LIKE ? ORDER BY seq", f"%-s{step}-t%")
