"""A run whose disk fills up (a real tmpfs of 1.5 MB, mounted by the test): the run ends with an
error naming the file it could not write, the newest checkpoint still verifies and loads, and
the trace store passes SQLite's integrity check. (The checkpoint writer's own ENOSPC path, with
the previous checkpoint intact: tests/run/test_durable.py.)"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest

from tracetrain.config import build_config
from tracetrain.run import checkpoint, durable
from tracetrain.run.trainer import train

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); test_durable injects ENOSPC")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_names_the_file_and_leaves_checkpoint_and_store_whole(small_disk):
    run_dir = small_disk / "run"
    cfg = build_config({}, [
        "task=continuous_task.py", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "rollout.tasks_per_step=2", "rollout.n_per_task=3",
        "rollout.max_tokens=6", "trainer.steps=500", "trainer.checkpoint_every=1",
        f"trainer.run_dir={run_dir}"])
    with pytest.raises(Exception) as e:  # noqa: PT011 (which write meets the full disk first varies)
        train(cfg, base_dir=SUPPORT, log=lambda *_: None)
    assert str(run_dir) in str(e.value) and ("full" in str(e.value) or "No space" in str(e.value))
    newest, _ = durable.newest_valid(run_dir)
    assert newest is not None and checkpoint.load(newest)["step"] >= 1
    db = sqlite3.connect(run_dir / "traces.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
