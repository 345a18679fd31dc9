"""The store: rollouts, their turns, rewards and events, durably, in one SQLite file.

Contract (`Store`): writes are `async` and return only after their transaction is committed, so a
gateway that answers 2xx after `await store.add_turn(...)` never loses an acknowledged turn when
its process is killed (`kill -9`). Reads are plain calls, cheap and safe from any thread.

`SQLiteStore(path)` implements it:
- WAL journal, `synchronous=NORMAL` by default: a commit is in the WAL (the OS page cache) before
  it is acknowledged, which survives the death of the process; `synchronous="FULL"` also fsyncs
  the WAL on every commit, which survives power loss at the cost of one fsync per group commit.
- Group commit: the writes that coroutines of one event loop issue during one loop iteration are
  run together, each in its own SAVEPOINT (one refused write does not undo the others; a group
  of one needs none), committed once, then each caller's future is resolved. With NORMAL this happens inline on the loop (a WAL
  append costs tens of microseconds; a hand-off to a writer thread cost more, and a millisecond of
  scheduling on a busy machine); with FULL the fsyncing commit runs in a worker thread. Checkpoints
  run in a background thread. Writes are serialised (one lock): a turn's index is `n_turns` of its
  rollout read and bumped inside the same transaction, so indices are dense, unique and in the
  order the writes reached the store.
- Reads use one read-only connection per thread; in WAL mode they never wait for the writer.
  The key lookup of every agent call (`head_by_key_hash`) is answered from memory after the first
  time: an indexed read costs ~20-30 µs here, mostly WAL locking. The cache is kept right by this
  store's own writes (a state change, rekey or delete drops the rollout's entry; a turn marks it
  running), so it assumes what the gateway assumes: one process writes the file, through one
  `SQLiteStore`. (A change made past it is still caught where it matters: a turn for a rollout
  that ended or is gone is refused inside its transaction.)
- Token ids are stored as little-endian int32 BLOBs and logprobs as little-endian float32 BLOBs
  (4 bytes per token; float32 keeps a logprob to ~1e-7 relative, the precision engines compute in).
- Schema versioned with `PRAGMA user_version`; `MIGRATIONS[k]` takes version k to k + 1.

A rollout's reward is its `reward_override` when the trainer set one, else the value of its last
`reward` event, else None.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import sys
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.types import (
    LEGAL_TRANSITIONS,
    TERMINAL_STATES,
    Rollout,
    RolloutState,
    Turn,
)

# --------------------------------------------------------------------------------------- errors


class StoreError(Exception):
    """A write the store refused; the message says why. Subclasses map to HTTP statuses."""


class UnknownRollout(StoreError):
    """No rollout with this id (404)."""


class IllegalTransition(StoreError):
    """A state change not in LEGAL_TRANSITIONS (409)."""


class RolloutEnded(StoreError):
    """A turn or agent event for a rollout already in a terminal state (409)."""


class RolloutConflict(StoreError):
    """Create with an existing id but a different group, task or engine (409)."""


# -------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class NewRollout:
    """What `create_rollouts` needs; `key_salt`/`key_hash` come from the gateway's keys module."""

    rollout_id: str
    group_id: str
    task: Any = None
    engine: str | None = None
    key_salt: bytes = b""
    key_hash: bytes = b""


@dataclass(frozen=True)
class RolloutRecord:
    rollout_id: str
    group_id: str
    task: Any
    engine: str | None
    state: RolloutState
    error: str | None
    reward: float | None  # reward_override if set, else the last reward event's value
    reward_override: float | None
    n_turns: int
    created_at: float
    updated_at: float
    seq: int  # insertion order; the paging cursor
    key_salt: bytes = field(repr=False, default=b"")
    key_hash: bytes = field(repr=False, default=b"")


@dataclass(frozen=True)
class RolloutHead:
    """What a model call needs to know about its rollout: cheap to read (no task JSON)."""

    rollout_id: str
    state: RolloutState
    engine: str | None
    key_hash: bytes = field(repr=False, default=b"")


@dataclass(frozen=True)
class TurnRecord:
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None
    model_version: int | None
    finish_reason: str | None
    created_at: float
    context: str | None = None  # how the prompt was built: exact | rendered (None: a raw prompt)
    context_reason: str | None = None  # why it was rendered in full (gateway/context.py REASONS)
    reused_tokens: int = 0  # prompt ids taken as they were from the earlier turn

    def to_turn(self) -> Turn:
        return Turn(self.prompt_ids, self.response_ids, self.response_logprobs, self.model_version)


@dataclass(frozen=True)
class EventRecord:
    event_id: int
    rollout_id: str
    kind: str
    payload: Any
    reward: float | None  # set for kind == "reward"
    created_at: float


# ------------------------------------------------------------------------------ the interface


class Store(ABC):
    """Durable rollouts, turns and events. Writes return after commit; reads are synchronous."""

    # writes
    @abstractmethod
    async def create_rollouts(
        self, rollouts: Sequence[NewRollout]
    ) -> list[tuple[RolloutRecord, bool]]:
        """Insert each rollout unless its id exists (then: same group/task/engine -> returned with
        created=False; different -> RolloutConflict, and nothing of the batch is written)."""

    @abstractmethod
    async def rekey_rollout(self, rollout_id: str, key_salt: bytes, key_hash: bytes) -> None: ...

    @abstractmethod
    async def set_state(
        self, rollout_id: str, state: RolloutState | str, error: str | None = None
    ) -> RolloutRecord:
        """Move a rollout to `state` if LEGAL_TRANSITIONS allows (setting the current state again
        is a no-op); IllegalTransition otherwise."""

    @abstractmethod
    async def start(self, rollout_id: str) -> RolloutRecord:
        """queued -> running; a running rollout is returned as is; RolloutEnded if terminal."""

    @abstractmethod
    async def add_turn(
        self,
        rollout_id: str,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        response_logprobs: Sequence[float] | None,
        model_version: int | None,
        finish_reason: str | None,
        context: tuple[str | None, str | None, int] = (None, None, 0),
    ) -> int:
        """Append a turn and return its index (0, 1, ...). A queued rollout becomes running;
        RolloutEnded if it is terminal. `context`: how its prompt was built, (context, reason,
        reused_tokens) as in TurnRecord."""

    @abstractmethod
    async def add_event(
        self,
        rollout_id: str,
        kind: str,
        payload: Any = None,
        reward: float | None = None,
        *,
        allow_ended: bool = True,
    ) -> EventRecord:
        """Append an event; kind "reward" carries `reward`, which becomes the rollout's reward."""

    @abstractmethod
    async def set_reward_override(self, rollout_id: str, reward: float | None) -> RolloutRecord: ...

    @abstractmethod
    async def delete_rollout(self, rollout_id: str) -> bool: ...

    @abstractmethod
    async def put_engine(self, name: str, spec: dict[str, Any]) -> None: ...

    # reads
    @abstractmethod
    def get_rollout(self, rollout_id: str) -> RolloutRecord | None: ...

    @abstractmethod
    def get_head(self, rollout_id: str) -> RolloutHead | None: ...

    @abstractmethod
    def head_by_key_hash(self, key_hash: bytes) -> RolloutHead | None:
        """The rollout whose key hashes to `key_hash` (the key lookup of every agent request)."""

    @abstractmethod
    def get_turns(self, rollout_id: str) -> list[TurnRecord]: ...

    @abstractmethod
    def turn_contexts(self, rollout_ids: Iterable[str]) -> list[tuple[str | None, str | None, int]]:
        """(context, context_reason, reused_tokens) of every turn of these rollouts."""

    @abstractmethod
    def list_rollouts(
        self,
        *,
        state: RolloutState | str | None = None,
        group_id: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[RolloutRecord]:
        """Rollouts with seq > `after`, in insertion order, at most `limit`."""

    @abstractmethod
    def list_events(self, rollout_id: str, kind: str | None = None) -> list[EventRecord]: ...

    @abstractmethod
    def list_engines(self) -> dict[str, dict[str, Any]]: ...

    def load_rollouts(
        self,
        *,
        rollout_ids: Iterable[str] | None = None,
        group_id: str | None = None,
        states: Iterable[RolloutState | str] = TERMINAL_STATES,
    ) -> list[Rollout]:
        """Finished rollouts as `tracetrain.types.Rollout` (validated), for the trainer."""
        wanted = {RolloutState(s) for s in states}
        if rollout_ids is not None:
            rollout_ids = list(rollout_ids)
            records = [self.get_rollout(i) for i in rollout_ids]
            missing = [i for i, r in zip(rollout_ids, records, strict=True) if r is None]
            if missing:
                raise UnknownRollout(f"unknown rollout ids: {missing[:10]}")
        else:
            records, after = [], 0
            while page := self.list_rollouts(group_id=group_id, after=after, limit=1000):
                records += page
                after = page[-1].seq
        out = []
        for r in records:
            if r.state not in wanted or (group_id is not None and r.group_id != group_id):
                continue
            out.append(Rollout(r.rollout_id, r.group_id, self.training_turns(r.rollout_id), r.reward,
                               r.state))
        return out

    def training_turns(self, rollout_id: str) -> list[Turn]:
        """A rollout's turns as validated `Turn`s, for the trainer."""
        return [t.to_turn() for t in self.get_turns(rollout_id)]

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- blob encoding

assert array("i").itemsize == 4 and array("f").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def ids_to_blob(ids: Sequence[int]) -> bytes:
    """Token ids -> little-endian int32 bytes (4 per id)."""
    a = array("i", ids)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def blob_to_id_array(blob: bytes) -> array:
    """Little-endian int32 bytes -> array('i') (one copy, no Python ints)."""
    a = array("i")
    a.frombytes(blob)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def blob_to_ids(blob: bytes) -> list[int]:
    return blob_to_id_array(blob).tolist()


def floats_to_blob(xs: Sequence[float]) -> bytes:
    """Floats -> little-endian float32 bytes (4 per value)."""
    a = array("f", xs)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def blob_to_float_array(blob: bytes) -> array:
    """Little-endian float32 bytes -> array('f')."""
    a = array("f")
    a.frombytes(blob)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def blob_to_floats(blob: bytes) -> list[float]:
    return blob_to_float_array(blob).tolist()


# -------------------------------------------------------------------------------- schema

_STATES = ", ".join(f"'{s.value}'" for s in RolloutState)

MIGRATIONS: list[str] = [
    # 0 -> 1
    f"""
    CREATE TABLE rollouts (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id TEXT NOT NULL UNIQUE,
        group_id TEXT NOT NULL,
        task TEXT NOT NULL,                 -- JSON
        engine TEXT,                        -- engine name; NULL = the gateway's default
        state TEXT NOT NULL CHECK (state IN ({_STATES})),
        error TEXT,
        reward_event REAL,                  -- value of the last reward event
        reward_override REAL,               -- set by the trainer; wins over reward_event
        n_turns INTEGER NOT NULL DEFAULT 0,
        key_salt BLOB NOT NULL,
        key_hash BLOB NOT NULL UNIQUE,      -- sha256 of the rollout's key; the key is never stored
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX rollouts_by_state ON rollouts (state, seq);
    CREATE INDEX rollouts_by_group ON rollouts (group_id, seq);
    CREATE TABLE turns (
        rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        prompt_ids BLOB NOT NULL,           -- int32 little-endian
        response_ids BLOB NOT NULL,         -- int32 little-endian
        logprobs BLOB,                      -- float32 little-endian, one per response id
        model_version INTEGER,
        finish_reason TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (rollout_id, idx)
    ) WITHOUT ROWID;
    CREATE TABLE events (
        event_id INTEGER PRIMARY KEY AUTOINCREMENT,
        rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id) ON DELETE CASCADE,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,              -- JSON
        reward REAL,
        created_at REAL NOT NULL
    );
    CREATE INDEX events_by_rollout ON events (rollout_id, event_id);
    CREATE TABLE engines (
        name TEXT PRIMARY KEY,
        spec TEXT NOT NULL,                 -- JSON: how to rebuild the engine
        created_at REAL NOT NULL
    );
    """,
    # 1 -> 2: how each turn's prompt was built (gateway/context.py)
    """
    ALTER TABLE turns ADD COLUMN context TEXT;          -- exact | rendered; NULL: a raw prompt
    ALTER TABLE turns ADD COLUMN context_reason TEXT;   -- why it was rendered in full
    ALTER TABLE turns ADD COLUMN reused_tokens INTEGER NOT NULL DEFAULT 0;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)

_ROLLOUT_COLUMNS = (
    "rollout_id, group_id, task, engine, state, error, "
    "COALESCE(reward_override, reward_event), reward_override, n_turns, created_at, updated_at, "
    "seq, key_salt, key_hash"
)


def _rollout(row: tuple) -> RolloutRecord:
    return RolloutRecord(row[0], row[1], json.loads(row[2]), row[3], RolloutState(row[4]), *row[5:])


def _connect(path: str, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise StoreError(f"{path}: SQLite refused WAL mode (journal_mode is {mode!r})")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def migrate(conn: sqlite3.Connection, path: str = "") -> int:
    """Bring the schema to SCHEMA_VERSION, one migration per transaction. Returns the version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: schema version {version} is newer than this tracetrain knows "
            f"({SCHEMA_VERSION}); upgrade tracetrain"
        )
    for v in range(version, SCHEMA_VERSION):
        conn.executescript(
            f"BEGIN IMMEDIATE; {MIGRATIONS[v]}; PRAGMA user_version = {v + 1}; COMMIT;"
        )
    return SCHEMA_VERSION


# ----------------------------------------------------- write operations (inside a group commit)
# Each takes the write connection as first argument and runs inside the group's transaction.


def _now() -> float:
    return time.time()


def _get(conn: sqlite3.Connection, rollout_id: str) -> RolloutRecord:
    row = conn.execute(
        f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    ).fetchone()
    if row is None:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return _rollout(row)


def _op_create(conn, rollouts: Sequence[NewRollout]) -> list[tuple[RolloutRecord, bool]]:
    out = []
    now = _now()
    for r in rollouts:
        task = json.dumps(r.task, allow_nan=False, separators=(",", ":"))
        row = conn.execute(
            f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (r.rollout_id,)
        ).fetchone()
        if row is not None:
            old = _rollout(row)
            if (old.group_id, old.task, old.engine) != (r.group_id, json.loads(task), r.engine):
                raise RolloutConflict(
                    f"rollout {r.rollout_id!r} already exists with a different group_id, task or "
                    "engine; creating with an existing id is only allowed with the same values"
                )
            out.append((old, False))
            continue
        conn.execute(
            "INSERT INTO rollouts (rollout_id, group_id, task, engine, state, key_salt, key_hash,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?)",
            (r.rollout_id, r.group_id, task, r.engine, r.key_salt, r.key_hash, now, now),
        )
        out.append((_get(conn, r.rollout_id), True))
    return out


def _op_rekey(conn, rollout_id: str, key_salt: bytes, key_hash: bytes) -> None:
    cur = conn.execute(
        "UPDATE rollouts SET key_salt = ?, key_hash = ?, updated_at = ? WHERE rollout_id = ?",
        (key_salt, key_hash, _now(), rollout_id),
    )
    if cur.rowcount == 0:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")


def _op_set_state(conn, rollout_id: str, state: RolloutState, error: str | None) -> RolloutRecord:
    old = _get(conn, rollout_id)
    if state == old.state:
        return old
    if state not in LEGAL_TRANSITIONS[old.state]:
        allowed = ", ".join(sorted(s.value for s in LEGAL_TRANSITIONS[old.state])) or "none"
        raise IllegalTransition(
            f"rollout {rollout_id!r} cannot go from {old.state.value} to {state.value} "
            f"(allowed from {old.state.value}: {allowed})"
        )
    conn.execute(
        "UPDATE rollouts SET state = ?, error = COALESCE(?, error), updated_at = ? "
        "WHERE rollout_id = ?",
        (state.value, error, _now(), rollout_id),
    )
    return _get(conn, rollout_id)


def _check_open(rollout: RolloutRecord, what: str) -> None:
    if rollout.state in TERMINAL_STATES:
        raise RolloutEnded(
            f"rollout {rollout.rollout_id!r} has ended ({rollout.state.value}); no more {what}"
        )


def _op_start(conn, rollout_id: str) -> RolloutRecord:
    r = _get(conn, rollout_id)
    _check_open(r, "model calls")
    if r.state == RolloutState.queued:
        conn.execute(
            "UPDATE rollouts SET state = 'running', updated_at = ? WHERE rollout_id = ?",
            (_now(), rollout_id),
        )
        r = _get(conn, rollout_id)
    return r


def _op_add_turn(
    conn, rollout_id, prompt_ids, response_ids, response_logprobs, model_version, finish_reason,
    context,
) -> int:
    row = conn.execute(
        "SELECT state, n_turns FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    ).fetchone()
    if row is None:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    state, index = RolloutState(row[0]), row[1]
    if state in TERMINAL_STATES:
        raise RolloutEnded(f"rollout {rollout_id!r} has ended ({state.value}); no more turns")
    now = _now()
    conn.execute(
        "INSERT INTO turns (rollout_id, idx, prompt_ids, response_ids, logprobs, model_version,"
        " finish_reason, created_at, context, context_reason, reused_tokens)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            rollout_id,
            index,
            ids_to_blob(prompt_ids),
            ids_to_blob(response_ids),
            None if response_logprobs is None else floats_to_blob(response_logprobs),
            model_version,
            finish_reason,
            now,
            *context,
        ),
    )
    conn.execute(
        "UPDATE rollouts SET n_turns = ?, state = 'running', updated_at = ? WHERE rollout_id = ?",
        (index + 1, now, rollout_id),
    )
    return index


def _op_add_event(conn, rollout_id, kind, payload, reward, allow_ended) -> EventRecord:
    r = _get(conn, rollout_id)
    if not allow_ended:
        _check_open(r, "events from the agent")
    now = _now()
    cur = conn.execute(
        "INSERT INTO events (rollout_id, kind, payload, reward, created_at) VALUES (?, ?, ?, ?, ?)",
        (
            rollout_id,
            kind,
            json.dumps(payload, allow_nan=False, separators=(",", ":")),
            reward,
            now,
        ),
    )
    if kind == "reward":
        conn.execute(
            "UPDATE rollouts SET reward_event = ?, updated_at = ? WHERE rollout_id = ?",
            (reward, now, rollout_id),
        )
    return EventRecord(cur.lastrowid, rollout_id, kind, payload, reward, now)


def _op_set_override(conn, rollout_id: str, reward: float | None) -> RolloutRecord:
    cur = conn.execute(
        "UPDATE rollouts SET reward_override = ?, updated_at = ? WHERE rollout_id = ?",
        (reward, _now(), rollout_id),
    )
    if cur.rowcount == 0:
        raise UnknownRollout(f"rollout {rollout_id!r} does not exist")
    return _get(conn, rollout_id)


def _op_delete(conn, rollout_id: str) -> bool:
    return conn.execute("DELETE FROM rollouts WHERE rollout_id = ?", (rollout_id,)).rowcount > 0


def _op_put_engine(conn, name: str, spec: dict) -> None:
    conn.execute(
        "INSERT INTO engines (name, spec, created_at) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
        (name, json.dumps(spec, allow_nan=False), _now()),
    )


# ------------------------------------------------------------------------------ group commit

_Op = tuple[Callable[..., Any], tuple, asyncio.Future]


class _GroupCommit:
    """Commits the writes of one event-loop iteration together (see the module docstring).

    `submit` queues a write on its event loop and schedules one flush for that loop; the flush runs
    the queued writes in one transaction, one SAVEPOINT each (none for a group of one), commits,
    and resolves their futures.
    With synchronous=NORMAL the commit is an append to the WAL (no fsync), done inline on the loop:
    no thread hand-off. With FULL it fsyncs, so the flush runs in a worker thread, and the writes
    that arrive meanwhile form the next group. A lock serialises flushes from several loops.
    WAL checkpoints (which fsync) run in a background thread, never in a flush.
    """

    CHECKPOINT_EVERY = 256  # commits between background checkpoints

    def __init__(self, conn: sqlite3.Connection, path: str, synchronous: str):
        self.conn, self.path, self.synchronous = conn, path, synchronous
        self.offload = synchronous == "FULL"
        self.lock = threading.Lock()
        self.pending: dict[asyncio.AbstractEventLoop, list[_Op]] = {}
        self.groups = 0  # commits done (for tests and metrics)
        self.writes = 0
        self._checkpointer: threading.Thread | None = None
        conn.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints are ours, off the loop
        conn.execute("PRAGMA journal_size_limit=67108864")  # WAL file kept at most 64 MB

    async def submit(self, fn: Callable[..., Any], args: tuple) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        group = self.pending.get(loop)
        if group is None:
            group = self.pending[loop] = []
            loop.call_soon(self._flush, loop)
        group.append((fn, args, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.offload:
            loop.run_in_executor(None, self._commit_from_thread, loop, self.pending.pop(loop))
            return
        if not self.lock.acquire(blocking=False):  # a checkpoint's last pass: the loop goes on,
            loop.call_later(0.0005, self._flush, loop)  # and writes keep joining this group
            return
        try:
            results = self._commit(self.pending.pop(loop))
        finally:
            self.lock.release()
        self._resolve(results)

    def _commit_from_thread(self, loop, group: list[_Op]) -> None:
        with self.lock:
            results = self._commit(group)
        loop.call_soon_threadsafe(self._resolve, results)

    @staticmethod
    def _resolve(results) -> None:
        for fut, value, err in results:
            if fut.done():  # its caller was cancelled; the write stands
                continue
            if err is None:
                fut.set_result(value)
            else:
                fut.set_exception(err)

    def _commit(self, group: list[_Op]) -> list[tuple[asyncio.Future, Any, BaseException | None]]:
        """Run and commit one group; the caller holds the lock."""
        results: list[tuple[asyncio.Future, Any, BaseException | None]] = []
        conn = self.conn
        savepoints = len(group) > 1  # a group of one needs none: its failure is the rollback
        try:
            conn.execute("BEGIN IMMEDIATE")
            for fn, args, fut in group:
                if savepoints:
                    conn.execute("SAVEPOINT op")
                try:
                    value = fn(conn, *args)
                except Exception as e:  # this write fails alone; the group goes on
                    conn.execute("ROLLBACK TO op" if savepoints else "ROLLBACK")
                    results.append((fut, None, e))
                else:
                    results.append((fut, value, None))
                if savepoints:
                    conn.execute("RELEASE op")
            if conn.in_transaction:
                conn.execute("COMMIT")
        except Exception as e:  # the commit itself failed (disk full, I/O error): nothing holds
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            err = StoreError(f"store write failed: {type(e).__name__}: {e}")
            results = [(fut, None, err) for _, _, fut in group]
        self.groups += 1
        self.writes += len(group)
        if self.groups % self.CHECKPOINT_EVERY == 0:
            self._start_checkpoint()
        return results

    def _start_checkpoint(self) -> None:
        if self._checkpointer is not None and self._checkpointer.is_alive():
            return
        self._checkpointer = threading.Thread(
            target=self._checkpoint, name="tracetrain-store-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def _checkpoint(self) -> None:
        """Copy WAL frames into the database file without blocking writers (PASSIVE)."""
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        try:
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            # Copy while writes go on, then a last pass holding the write lock (the loop keeps
            # serving; its writes wait in their group), so that every frame is copied and the next
            # write starts the WAL over instead of growing it.
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            with self.lock:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            pass  # a later checkpoint catches up
        finally:
            conn.close()

    def close(self) -> None:
        if self._checkpointer is not None:  # before the lock: its last pass takes the lock
            self._checkpointer.join()
        with self.lock:
            try:
                self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass
            self.conn.close()


# ------------------------------------------------------------------------------ SQLiteStore


class SQLiteStore(Store):
    """See the module docstring. `path` is a file (":memory:" cannot be shared between threads)."""

    MAX_CACHED_HEADS = 100_000  # ~200 bytes each; the cache starts over when full

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL"):
        synchronous = synchronous.upper()
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        self.path = str(path)
        if self.path == ":memory:" or self.path.startswith("file::memory:"):
            raise ValueError(
                "SQLiteStore needs a file path; ':memory:' is not shared between threads"
            )
        self.synchronous = synchronous
        conn = _connect(self.path, synchronous)
        migrate(conn, self.path)
        self._writer = _GroupCommit(conn, self.path, synchronous)
        self._local = threading.local()
        self._heads: dict[bytes, RolloutHead] = {}  # key hash -> head (see the docstring)
        self._key_of: dict[str, bytes] = {}  # rollout id -> key hash, for _heads
        self._heads_lock = threading.Lock()
        self._generation = 0
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False

    # -- plumbing
    async def _write(self, fn: Callable[..., Any], *args) -> Any:
        if self._closed:
            raise StoreError("store is closed")
        return await self._writer.submit(fn, args)

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreError("store is closed")
            conn = _connect(self.path, self.synchronous)
            conn.execute("PRAGMA query_only=ON")
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    @property
    def commits(self) -> int:
        """Group commits done so far (each may hold many writes)."""
        return self._writer.groups

    # -- writes
    async def create_rollouts(self, rollouts):
        return await self._write(_op_create, list(rollouts))

    async def rekey_rollout(self, rollout_id, key_salt, key_hash):
        try:
            await self._write(_op_rekey, rollout_id, key_salt, key_hash)
        finally:
            self._forget(rollout_id)

    async def set_state(self, rollout_id, state, error=None):
        try:
            return await self._write(_op_set_state, rollout_id, RolloutState(state), error)
        finally:
            self._forget(rollout_id)

    async def start(self, rollout_id):
        try:
            record = await self._write(_op_start, rollout_id)
        except StoreError:
            self._forget(rollout_id)
            raise
        self._running(rollout_id)
        return record

    async def add_turn(
        self,
        rollout_id,
        prompt_ids,
        response_ids,
        response_logprobs,
        model_version,
        finish_reason,
        context=(None, None, 0),
    ):
        try:
            index = await self._write(
                _op_add_turn,
                rollout_id,
                prompt_ids,
                response_ids,
                response_logprobs,
                model_version,
                finish_reason,
                context,
            )
        except StoreError:
            self._forget(rollout_id)
            raise
        self._running(rollout_id)
        return index

    async def add_event(self, rollout_id, kind, payload=None, reward=None, *, allow_ended=True):
        if (kind == "reward") != (reward is not None):
            raise ValueError("an event carries a reward exactly when its kind is 'reward'")
        return await self._write(_op_add_event, rollout_id, kind, payload, reward, allow_ended)

    async def set_reward_override(self, rollout_id, reward):
        return await self._write(_op_set_override, rollout_id, reward)

    async def delete_rollout(self, rollout_id):
        try:
            return await self._write(_op_delete, rollout_id)
        finally:
            self._forget(rollout_id)

    # -- the head cache (module docstring). A read that missed fills it only if no write touched
    # a head while it read (`_generation`), so a reader thread cannot put back what a write dropped.
    def _forget(self, rollout_id: str) -> None:
        with self._heads_lock:
            self._generation += 1
            key_hash = self._key_of.pop(rollout_id, None)
            if key_hash is not None:
                self._heads.pop(key_hash, None)

    def _running(self, rollout_id: str) -> None:
        """A turn or start committed: the rollout is running (it was queued or running)."""
        with self._heads_lock:
            self._generation += 1
            key_hash = self._key_of.get(rollout_id)
            head = None if key_hash is None else self._heads.get(key_hash)
            if head is not None and head.state != RolloutState.running:
                self._heads[key_hash] = dataclasses.replace(head, state=RolloutState.running)

    async def put_engine(self, name, spec):
        await self._write(_op_put_engine, name, spec)

    # -- reads
    def get_rollout(self, rollout_id):
        row = (
            self._reader()
            .execute(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,))
            .fetchone()
        )
        return None if row is None else _rollout(row)

    def get_head(self, rollout_id):
        row = (
            self._reader()
            .execute(
                "SELECT rollout_id, state, engine, key_hash FROM rollouts WHERE rollout_id = ?",
                (rollout_id,),
            )
            .fetchone()
        )
        return None if row is None else RolloutHead(row[0], RolloutState(row[1]), row[2], row[3])

    def head_by_key_hash(self, key_hash):
        head = self._heads.get(key_hash)
        if head is not None:
            return head
        generation = self._generation
        row = (
            self._reader()
            .execute(
                "SELECT rollout_id, state, engine, key_hash FROM rollouts WHERE key_hash = ?",
                (key_hash,),
            )
            .fetchone()
        )
        if row is None:
            return None
        head = RolloutHead(row[0], RolloutState(row[1]), row[2], row[3])
        with self._heads_lock:
            if generation == self._generation:
                if len(self._heads) >= self.MAX_CACHED_HEADS:
                    self._heads.clear()
                    self._key_of.clear()
                self._heads[head.key_hash] = head
                self._key_of[head.rollout_id] = head.key_hash
        return head

    def _turn_rows(self, rollout_id: str) -> list[tuple]:
        """(idx, prompt_ids, response_ids, logprobs, model_version, finish_reason, created_at,
        context, context_reason, reused_tokens)."""
        return (
            self._reader()
            .execute(
                "SELECT idx, prompt_ids, response_ids, logprobs, model_version, finish_reason,"
                " created_at, context, context_reason, reused_tokens"
                " FROM turns WHERE rollout_id = ? ORDER BY idx",
                (rollout_id,),
            )
            .fetchall()
        )

    def get_turns(self, rollout_id):
        return [
            TurnRecord(
                idx,
                blob_to_ids(p),
                blob_to_ids(r),
                None if lp is None else blob_to_floats(lp),
                mv,
                fr,
                ts,
                *how,
            )
            for idx, p, r, lp, mv, fr, ts, *how in self._turn_rows(rollout_id)
        ]

    def turn_contexts(self, rollout_ids):
        conn, out = self._reader(), []
        for rid in rollout_ids:
            out += conn.execute(
                "SELECT context, context_reason, reused_tokens FROM turns WHERE rollout_id = ?",
                (rid,),
            ).fetchall()
        return out

    def training_turns(self, rollout_id):
        """Turns with ids as int32 arrays and logprobs as float32 arrays: the stored bytes, copied
        once, never turned into Python numbers (aggregate reads them as memory)."""
        return [
            Turn(blob_to_id_array(p), blob_to_id_array(r),
                 None if lp is None else blob_to_float_array(lp), mv)
            for _, p, r, lp, mv, *_ in self._turn_rows(rollout_id)
        ]

    def list_rollouts(self, *, state=None, group_id=None, after=0, limit=100):
        where, args = ["seq > ?"], [after]
        if state is not None:
            where.append("state = ?")
            args.append(RolloutState(state).value)
        if group_id is not None:
            where.append("group_id = ?")
            args.append(group_id)
        rows = (
            self._reader()
            .execute(
                f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE {' AND '.join(where)} "
                "ORDER BY seq LIMIT ?",
                (*args, limit),
            )
            .fetchall()
        )
        return [_rollout(r) for r in rows]

    def list_events(self, rollout_id, kind=None):
        sql = "SELECT event_id, rollout_id, kind, payload, reward, created_at FROM events "
        sql += "WHERE rollout_id = ?" + (" AND kind = ?" if kind is not None else "")
        args = (rollout_id,) if kind is None else (rollout_id, kind)
        rows = self._reader().execute(sql + " ORDER BY event_id", args).fetchall()
        return [EventRecord(i, r, k, json.loads(p), rw, ts) for i, r, k, p, rw, ts in rows]

    def list_engines(self):
        rows = self._reader().execute("SELECT name, spec FROM engines ORDER BY name").fetchall()
        return {name: json.loads(spec) for name, spec in rows}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
