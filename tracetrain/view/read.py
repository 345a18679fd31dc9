"""A run directory, read-only, for the viewer: its config, its metric lines, its trace store.

Everything is read when asked (a page shows the run as it is now, while it trains) and cached
only where the file has not changed: metrics.jsonl by (size, mtime), a step's rows by the state
of its rollouts. The store is opened read-only (SQLite mode=ro): the trainer's writes never wait
for the viewer. A file that is missing or cannot be read raises RunFileProblem naming it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracetrain.config import TrainConfig
from tracetrain.run.teacher import teacher_scores
from tracetrain.store import SQLiteStore
from tracetrain.store.records import RolloutRecord, StoreError, StoreNotReady, TurnRecord
from tracetrain.types import Rollout, RolloutState
from tracetrain.view.explain import StepExplained, explain_step


class RunFileProblem(Exception):
    """A run file the page needs is missing (`missing`) or unreadable; the message names it."""

    def __init__(self, path: Path, problem: str, *, missing: bool = False):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem, self.missing = path, problem, missing


@dataclass
class Metrics:
    steps: list[dict]  # one dict per step line, in file order
    problems: list[str]  # lines that are not JSON objects, named by number


def step_of(group_id: str) -> int | None:
    """The step of a training group id `<run>-s<step>-t<task>` (None: an eval or other group)."""
    head = group_id.rsplit("-t", 1)[0]
    _, _, step = head.rpartition("-s")
    return int(step) if step.isdigit() else None


class RunDir:
    """One run directory. Thread-safe: the viewer's routes run in a thread pool."""

    STEP_CACHE = 8  # explained steps kept (a step is recomputed when its rollouts change)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._metrics: tuple[tuple[int, int], Metrics] | None = None
        self._store: SQLiteStore | None = None
        self._tokenizer: tuple[Any] | None = None
        self._steps: OrderedDict[tuple, StepExplained] = OrderedDict()

    # -- files
    def config_json(self) -> dict | None:
        """config.json as written by the trainer (None when there is none)."""
        path = self.path / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunFileProblem(path, f"not readable as JSON ({e})") from None

    def config(self) -> TrainConfig | None:
        raw = self.config_json()
        if raw is None:
            return None
        try:
            return TrainConfig.model_validate(raw)
        except ValueError as e:
            raise RunFileProblem(self.path / "config.json", f"not a tracetrain config ({e})") from None

    def metrics(self) -> Metrics:
        """metrics.jsonl's step lines; a last line without its newline is being written and is
        left for the next read."""
        path = self.path / "metrics.jsonl"
        try:
            st = path.stat()
        except FileNotFoundError:
            return Metrics([], [])
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._metrics is not None and self._metrics[0] == key:
                return self._metrics[1]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise RunFileProblem(path, f"not readable ({e})") from None
        steps, problems = [], []
        lines = data.split(b"\n")
        for n, line in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                problems.append(f"metrics.jsonl line {n} is not JSON ({e})")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                problems.append(f"metrics.jsonl line {n} is not a step's metrics (no integer 'step')")
                continue
            steps.append(row)
        out = Metrics(steps, problems)
        with self._lock:
            self._metrics = (key, out)
        return out

    def store(self) -> SQLiteStore:
        path = self.path / "traces.db"
        with self._lock:
            if self._store is None:
                if not path.is_file():
                    raise RunFileProblem(path, "no trace store here", missing=True)
                try:
                    self._store = SQLiteStore(path, read_only=True)
                except StoreError as e:
                    raise RunFileProblem(path, str(e).removeprefix(f"{path}: "),
                                         missing=isinstance(e, StoreNotReady)) from None
            return self._store

    def tokenizer(self):
        """The policy's tokenizer from the config (None without one, or when it cannot load:
        tokens are then shown as ids)."""
        with self._lock:
            if self._tokenizer is None:
                tok = None
                try:
                    cfg = self.config()
                    if cfg is not None:
                        from tracetrain.models.load import load_tokenizer

                        tok = load_tokenizer(cfg.model)
                except Exception:  # a model that is not on this machine: ids instead of text
                    tok = None
                self._tokenizer = (tok,)
            return self._tokenizer[0]

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    # -- the store, read
    def _read(self, fn, *args):
        try:
            return fn(*args)
        except StoreError as e:
            raise RunFileProblem(self.path / "traces.db", str(e)) from None
        except Exception as e:  # sqlite3.DatabaseError and kin: a damaged file
            raise RunFileProblem(self.path / "traces.db", f"{type(e).__name__}: {e}") from None

    def step_records(self, step: int) -> list[RolloutRecord]:
        """The rollouts of training step `step` (every state), in insertion order: the groups its
        metrics name (continuous collection trains groups dealt from other steps), else those
        dealt from it."""
        store = self.store()
        named = next((m["collect/groups"] for m in self.metrics().steps
                      if m["step"] == step and isinstance(m.get("collect/groups"), list)), None)
        if named is not None:
            return [r for g in named if isinstance(g, str)
                    for r in self._read(lambda g=g: store.list_rollouts(group_id=g, limit=100_000))]
        out, after = [], 0
        while page := self._read(lambda a: store.list_rollouts(group_glob=f"*-s{step}-t*",
                                                                 after=a, limit=1000), after):
            out += [r for r in page if step_of(r.group_id) == step]
            after = page[-1].seq
        return out

    def has_step(self, step: int) -> bool:
        store = self.store()
        page = self._read(lambda: store.list_rollouts(group_glob=f"*-s{step}-t*", limit=1))
        return bool(page)

    def rollout(self, rollout_id: str) -> tuple[RolloutRecord, list[TurnRecord]] | None:
        store = self.store()
        rec = self._read(store.get_rollout, rollout_id)
        if rec is None:
            return None
        return rec, self._read(store.get_turns, rollout_id)

    def explained(self, step: int, records: list[RolloutRecord], policy: str | None = None) -> StepExplained:
        """The step's finished rollouts through aggregate, credit and plan (explain.py), cached
        while none of them changes; with several policies, as policy `policy` learned from them
        (TrainConfig.for_policy)."""
        # finished, with its reward: a run that is training may have marked a rollout succeeded a
        # moment before its reward is written (that rollout is explained on the next read)
        done = [r for r in records if r.state.terminal
                and not (r.state == RolloutState.succeeded and r.reward is None)]
        key = (step, policy, tuple((r.rollout_id, r.updated_at) for r in done))
        with self._lock:
            if key in self._steps:
                self._steps.move_to_end(key)
                return self._steps[key]
        store = self.store()
        rollouts = [Rollout(r.rollout_id, r.group_id,
                            [t.to_turn() for t in self._read(store.get_turns, r.rollout_id)],
                            r.reward, RolloutState(r.state)) for r in done]
        cfg = self.config() or TrainConfig()
        mine = cfg.for_policy(policy) if policy is not None else cfg
        scores = (self._read(teacher_scores, store, [r.rollout_id for r in done])
                  if mine.distill is not None else None)
        out = explain_step(rollouts, mine, self.tokenizer(), scores)
        with self._lock:
            self._steps[key] = out
            while len(self._steps) > self.STEP_CACHE:
                self._steps.popitem(last=False)
        return out
