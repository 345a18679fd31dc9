"""Group commit: the writes of one event-loop iteration in one transaction (see `tracetrain.store`)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from tracetrain.store.records import StoreError

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
            err = StoreError(f"store write failed ({self.path}): {type(e).__name__}: {e}")
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
