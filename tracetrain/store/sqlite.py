"""`SQLiteStore`: the `Store` in one SQLite file (WAL, group commit, per-thread readers, the key
lookup answered from memory; see `tracetrain.store`)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracetrain.store.base import Store
from tracetrain.store.group_commit import _GroupCommit
from tracetrain.store.records import (
    EventRecord,
    RolloutHead,
    StoreError,
    TurnRecord,
    TurnReward,
    blob_to_float_array,
    blob_to_floats,
    blob_to_id_array,
    blob_to_ids,
    turn_reward,
)
from tracetrain.store.schema import (
    _ROLLOUT_COLUMNS,
    _connect,
    _connect_read_only,
    _rollout,
    check_readable,
    migrate,
)
from tracetrain.store.writes import (
    _op_add_event,
    _op_add_turn,
    _op_add_turn_reward,
    _op_create,
    _op_delete,
    _op_put_engine,
    _op_rekey,
    _op_set_override,
    _op_set_state,
    _op_start,
)
from tracetrain.types import DEFAULT_ROLE, RolloutState, ToolStats, Turn

# Turn columns later schema versions added: (the version that added it, the column); a read-only
# store of an older file reads NULL for them.
_LATE_COLUMN_VERSIONS = ((5, "messages"), (6, "tool_calls"), (6, "tool_parse_failures"),
                         (6, "tool_unknown"))
_LATE_COLUMNS = ", ".join(c for _, c in _LATE_COLUMN_VERSIONS)


class SQLiteStore(Store):
    """See the module docstring. `path` is a file (":memory:" cannot be shared between threads)."""

    MAX_CACHED_HEADS = 100_000  # ~200 bytes each; the cache starts over when full

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL", read_only: bool = False):
        """`read_only`: reads only, through read-only connections (a viewer beside a running
        trainer: it never takes the write lock); the file must exist with this schema version."""
        synchronous = synchronous.upper()
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        self.path = str(path)
        if self.path == ":memory:" or self.path.startswith("file::memory:"):
            raise ValueError(
                "SQLiteStore needs a file path; ':memory:' is not shared between threads"
            )
        self.synchronous, self.read_only = synchronous, read_only
        self._late_columns = _LATE_COLUMNS  # the turn columns later schemas added
        if read_only:
            version = check_readable(self.path)  # a file from before they were kept: NULL
            self._late_columns = ", ".join(c if version >= since else "NULL"
                                           for since, c in _LATE_COLUMN_VERSIONS)
            self._writer = None
        else:
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
        if self._writer is None:
            raise StoreError(f"{self.path}: the store was opened read-only")
        return await self._writer.submit(fn, args)

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreError("store is closed")
            conn = _connect_read_only(self.path) if self.read_only else _connect(self.path, self.synchronous)
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

    async def add_turn(self, rollout_id, turn):
        try:
            index = await self._write(_op_add_turn, rollout_id, turn)
        except StoreError:
            self._forget(rollout_id)
            raise
        self._running(rollout_id)
        return index

    async def add_event(self, rollout_id, kind, payload=None, reward=None, *, allow_ended=True):
        if (kind == "reward") != (reward is not None):
            raise ValueError("an event carries a reward exactly when its kind is 'reward'")
        return await self._write(_op_add_event, rollout_id, kind, payload, reward, allow_ended)

    async def add_turn_reward(self, rollout_id, reward, turn=None, name=None):
        return await self._write(_op_add_turn_reward, rollout_id, reward, turn, name)

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
        context, context_reason, reused_tokens, role, messages, tools), the ids as stored BLOBs,
        tools a ToolStats or None; a prompt kept as what it adds to turn k (prompt_from = k) is
        joined back: prompt(k) + response(k) + its ids."""
        rows = (
            self._reader()
            .execute(
                "SELECT idx, prompt_ids, response_ids, logprobs, model_version, finish_reason,"
                " created_at, context, context_reason, reused_tokens,"
                f" COALESCE(role, '{DEFAULT_ROLE}'), prompt_from, {self._late_columns}"
                " FROM turns WHERE rollout_id = ? ORDER BY idx",
                (rollout_id,),
            )
            .fetchall()
        )
        out: list[tuple] = []
        at: dict[int, int] = {}  # turn index -> position in out
        for idx, prompt, *rest, prompt_from, messages, calls, failures, unknown in rows:
            if prompt_from is not None:
                earlier = out[at[prompt_from]]
                prompt = earlier[1] + earlier[2] + prompt
            at[idx] = len(out)
            tools = None if calls is None else ToolStats(calls, failures or 0, unknown or 0)
            out.append((idx, prompt, *rest, messages, tools))
        return out

    def get_turns(self, rollout_id):
        rewards = self._rewards_by_turn(rollout_id)
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
                tuple(rewards.get(idx, ())),
                messages,
                tools,
            )
            for idx, p, r, lp, mv, fr, ts, *how, messages, tools in self._turn_rows(rollout_id)
        ]

    def get_turn_rewards(self, rollout_id):
        rows = (
            self._reader()
            .execute(
                "SELECT reward_id, rollout_id, turn, reward, name, created_at FROM turn_rewards"
                " WHERE rollout_id = ? ORDER BY turn, reward_id",
                (rollout_id,),
            )
            .fetchall()
        )
        return [TurnReward(*row) for row in rows]

    def _rewards_by_turn(self, rollout_id: str) -> dict[int, list[TurnReward]]:
        out: dict[int, list[TurnReward]] = {}
        for r in self.get_turn_rewards(rollout_id):
            out.setdefault(r.turn, []).append(r)
        return out

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
        rewards = self._rewards_by_turn(rollout_id)
        return [
            Turn(blob_to_id_array(p), blob_to_id_array(r),
                 None if lp is None else blob_to_float_array(lp), mv, role,
                 turn_reward(rewards.get(idx, ())), tools)
            for idx, p, r, lp, mv, _fr, _ts, _c, _cr, _ru, role, _m, tools in self._turn_rows(rollout_id)
        ]

    def list_rollouts(self, *, state=None, group_id=None, after=0, limit=100, group_glob=None):
        where, args = ["seq > ?"], [after]
        if group_glob is not None:
            where.append("group_id GLOB ?")
            args.append(group_glob)
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
        if self._writer is not None:
            self._writer.close()
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
