"""Checkpoint files whole or absent (run/durable.py, run/checkpoint.Checkpoints): any torn,
truncated or changed file is found out and the previous one used; a full disk leaves the previous
checkpoint as it was and says which path failed."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.run import checkpoint, durable

PAYLOAD = {"step": 3, "version": 3, "model": {"w": torch.arange(4096, dtype=torch.float32)},
           "optimizer": {}, "scheduler": {}, "rng": {}, "history": [{"step": 0}]}


def write_steps(run_dir: Path, steps: list[int], keep: int = 10) -> None:
    c = checkpoint.Checkpoints(run_dir, keep)
    for s in steps:
        c.write({**PAYLOAD, "step": s}, wait=True)
    c.close()


@settings(max_examples=40, deadline=None)
@given(cut=st.floats(0.0, 0.999), flip=st.integers(0, 10**9), mode=st.sampled_from(["truncate", "flip"]))
def test_a_torn_or_changed_checkpoint_is_found_out_and_the_previous_one_used(tmp_path_factory, cut, flip,
                                                                               mode):
    run = tmp_path_factory.mktemp("run")
    write_steps(run, [1, 2])
    newest = run / "checkpoints" / "step-000002.pt"
    data = bytearray(newest.read_bytes())
    if mode == "truncate":
        data = data[:int(cut * len(data))]
    else:
        data[flip % len(data)] ^= 1 + flip % 255
    newest.write_bytes(bytes(data))
    path, skipped = durable.newest_valid(run)
    assert path == run / "checkpoints" / "step-000001.pt"
    assert len(skipped) == 1 and str(newest) in skipped[0]
    assert checkpoint.load(path)["step"] == 1


def test_a_write_that_never_finished_is_not_a_checkpoint(tmp_path):
    write_steps(tmp_path, [1])
    folder = tmp_path / "checkpoints"
    shutil.copy(folder / "step-000001.pt", folder / "step-000002.pt")  # no sidecar: cut before it
    (folder / "step-000003.pt.tmp").write_bytes(b"half")  # cut before the rename
    path, skipped = durable.newest_valid(tmp_path)
    assert path == folder / "step-000001.pt" and "no .sha256" in skipped[0]
    write_steps(tmp_path, [4])  # the next write clears what a crash left
    assert not (folder / "step-000003.pt.tmp").exists()


def test_the_last_k_are_kept_and_checkpoint_pt_is_the_newest(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert [s for s, _ in durable.step_files(tmp_path / "checkpoints")] == [4, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000003.pt", "step-000003.pt.sha256", "step-000004.pt", "step-000004.pt.sha256"]
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 4


class FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes (torch.save writes through it)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b):
        self.room -= len(b)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_path(tmp_path, monkeypatch):
    write_steps(tmp_path, [1])
    before = (tmp_path / "checkpoints" / "step-000001.pt").read_bytes()
    real = durable._Hashing.__init__
    monkeypatch.setattr(durable._Hashing, "__init__", lambda self, f: real(self, FullDisk(f, 5000)))
    c = checkpoint.Checkpoints(tmp_path, keep=2)
    c.write({**PAYLOAD, "step": 2}, wait=False)  # written on its thread: the error comes at wait
    with pytest.raises(durable.CheckpointWriteError) as e:
        c.wait()
    c.close()
    message = str(e.value)
    assert "step-000002.pt" in message and "No space left on device" in message
    assert "the previous checkpoint" in message and "step-000001.pt" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001.pt",
                                                                            "step-000001.pt.sha256"]
    assert (tmp_path / "checkpoints" / "step-000001.pt").read_bytes() == before
    assert durable.newest_valid(tmp_path) == (tmp_path / "checkpoints" / "step-000001.pt", [])


def test_a_file_that_is_not_a_run_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"not a zip")
    with pytest.raises(checkpoint.CheckpointError, match="x.pt: not a loadable checkpoint"):
        checkpoint.load(tmp_path / "x.pt")
    torch.save({"step": 1}, tmp_path / "y.pt")
    with pytest.raises(checkpoint.CheckpointError, match="y.pt: not a run's checkpoint"):
        checkpoint.load(tmp_path / "y.pt")
