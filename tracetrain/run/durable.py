"""Checkpoint files that are whole or absent, whatever moment a crash or a full disk strikes.

    write      the payload goes to <name>.tmp while a sha256 of every byte is taken; the file is
               flushed and fsynced, renamed onto <name>, and the folder fsynced; then the
               sidecar <name>.sha256 ({"bytes", "sha256"}) the same way. A file without its
               sidecar, or whose size or digest differs from it, is not a checkpoint.
    layout     run_dir/checkpoints/step-<N>.pt (+ .sha256): the last `keep` written; the older
               ones are removed once a newer one is whole. run_dir/checkpoint.pt: a hard link to
               the newest (what `tracetrain eval --policy` and a person read).
    newest     the candidates newest first; `newest_valid` returns the first that verifies and
               names the ones it skipped (a torn write, a flipped bit, a truncated copy).

A write that fails (ENOSPC, EIO) removes its temporary file, leaves every earlier checkpoint as it
was, and raises CheckpointWriteError naming the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO

STEP_FILE = re.compile(r"step-(\d+)\.pt$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the message names the path and what is still intact)."""


class _Hashing:
    """A write-only file that hashes what passes through it (torch.save writes sequentially)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # what a write raised (torch.save reports it otherwise)

    def write(self, b) -> int:
        self.sha.update(b)
        self.bytes += len(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX: the directory entry is data of the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path, fill: Callable[[IO[bytes]], None]) -> tuple[int, str]:
    """fill(f) into `tmp`, fsync, rename onto `path`, fsync the folder -> (bytes, sha256)."""
    h = None
    try:
        with open(tmp, "wb") as f:
            h = _Hashing(f)
            fill(h)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if h is not None and h.error is not None and h.error is not e:
            raise h.error from e  # (torch.save turns a failed write into a RuntimeError)
        raise
    return h.bytes, h.sha.hexdigest()


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def write(path: Path, fill: Callable[[IO[bytes]], None]) -> Path:
    """`path` whole or absent (module docstring), then its sidecar; -> path."""
    size, digest = _replace_durably(path.with_name(path.name + ".tmp"), path, fill)
    data = json.dumps({"bytes": size, "sha256": digest}).encode()
    _replace_durably(sidecar(path).with_name(sidecar(path).name + ".tmp"), sidecar(path),
                     lambda f: f.write(data))
    return path


def verify(path: Path) -> str | None:
    """None when `path` matches its sidecar; else what is wrong with it."""
    side = sidecar(path)
    if not side.is_file():
        return "no .sha256 beside it (its write did not finish)"
    try:
        want = json.loads(side.read_text())
        size = path.stat().st_size
    except (OSError, ValueError) as e:
        return f"unreadable ({e})"
    if size != want.get("bytes"):
        return f"{size} bytes, {want.get('bytes')} written (truncated or torn)"
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    if sha.hexdigest() != want.get("sha256"):
        return "its sha256 differs from the one written (the file changed after it was written)"
    return None


def step_files(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoint files in `folder`, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)


def newest_valid(run_dir: Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint that verifies, or None; what was skipped and why). A run directory
    from before checkpoints/ existed: its checkpoint.pt, unverified."""
    steps = step_files(run_dir / "checkpoints")
    if not steps:
        legacy = run_dir / "checkpoint.pt"
        return (legacy if legacy.is_file() else None), []
    skipped = []
    for _, path in steps:
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path}: {problem}")
    return None, skipped


def publish(run_dir: Path, path: Path, keep: int) -> None:
    """After `path` (a step file) is whole: run_dir/checkpoint.pt links to it, and only the last
    `keep` step files stay."""
    link = run_dir / "checkpoint.pt"
    tmp = run_dir / "checkpoint.pt.link"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # a file system without hard links: a copy, written whole
        data = path.read_bytes()
        _replace_durably(tmp.with_name("checkpoint.pt.tmp"), tmp, lambda f: f.write(data))
    tmp.replace(link)
    fsync_dir(run_dir)
    for _, old in step_files(path.parent)[keep:]:
        sidecar(old).unlink(missing_ok=True)
        old.unlink(missing_ok=True)
