"""A Hugging Face hub cache built offline, in huggingface_hub's layout, for the tests of a model
named by its Hub id (tracetrain/models/hub.py):

    HF_HOME/hub/models--ORG--NAME/snapshots/<40-hex commit>/<the model's files>
    HF_HOME/hub/models--ORG--NAME/refs/<branch or tag>          (the commit, no newline)

`offline(monkeypatch, hf_home)` points the environment at it with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
from pathlib import Path


def commit_of(label: str) -> str:
    """A 40-hex commit hash, the same for the same label."""
    return hashlib.sha1(label.encode()).hexdigest()


def snapshot(hf_home: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """The (created) snapshot folder of `repo_id` at `commit`; each of `refs` names that commit."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return folder


def offline(monkeypatch, hf_home: Path) -> None:
    """HF_HOME=hf_home, HF_HUB_OFFLINE=1, and no other variable choosing the cache."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
