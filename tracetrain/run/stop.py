"""A run stopped by a signal: SIGTERM (a scheduler's preemption, `kill`) or SIGINT (Ctrl-C).

    first signal   `requested` is set and the loop stops at its next stop point: a collection or
                   an eval is cancelled (its rollouts end failed, never trained), an update stops
                   between two micro-batches before its first optimizer step (after it, the
                   update ends: a half-done update is no step's state). The run then writes the
                   checkpoint of its last completed step, stops every service it started
                   (agents, workers, engines, the gateway) and returns; `tracetrain train`
                   exits 0.
    grace          trainer.stop_grace_s after the first signal, if the run has not returned by
                   then, a watchdog ends the process: the vLLM servers it launched first, then
                   exit 1; the checkpoint on disk is the last one written before the signal.
    second signal  the watchdog's end at once, until the checkpoint is written; after it (the
                   services stopping: a server's end may signal its parent) it is logged.

Installed by the trainer's loop when it runs in the main thread (where signals are delivered).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """Raised at a stop point once a stop was requested."""


class Stop:
    """The stop request of one run (module docstring)."""

    def __init__(self, grace_s: float, log: Callable[[str], None] = print):
        self.grace_s, self.log = grace_s, log
        self.requested = threading.Event()  # read by the update thread between micro-batches
        self.signal: int | None = None
        self.at: float | None = None  # when the first signal came (time.monotonic)
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed: list[tuple[int, object]] = []
        self._over = threading.Event()  # the run has returned: the watchdog stands down
        self.saved = False  # the stop's checkpoint is written (a later signal waits for the end)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle SIGTERM and SIGINT in `loop` (nothing outside the main thread)."""
        self._loop, self._event = loop, asyncio.Event()
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            before = signal.getsignal(sig)
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._installed.append((sig, before))

    def uninstall(self) -> None:
        """The handlers from before `install` back; the grace's watchdog stands down."""
        self._over.set()
        for sig, before in self._installed:
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, before if before is not None else signal.SIG_DFL)
        self._installed = []

    def request(self, why: str) -> None:
        """Ask the run to stop (what a signal does; also callable by code)."""
        if self.requested.is_set():
            return
        self.at = time.monotonic()
        self.requested.set()
        if self._event is not None:
            self._event.set()
        self.log(f"stopping ({why}): the checkpoint of the last completed step is written, then "
                 f"the run ends (at most {self.grace_s:g} s)")
        threading.Thread(target=self._watchdog, name="stop-grace", daemon=True).start()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.requested.is_set() and self.saved:  # only the services' end is left (bounded by the grace)
            self.log(f"{name} again: the checkpoint is written; the services are stopping")
            return
        if self.requested.is_set():
            self._end_now(f"a second {name}")
        self.signal = sig
        self.request(name)

    def _watchdog(self) -> None:
        if not self._over.wait(self.grace_s):
            self._end_now(f"the grace of {self.grace_s:g} s ran out")

    def _end_now(self, why: str) -> None:
        from tracetrain.engines.vllm_server import stop_launched

        self.log(f"ending now ({why}); the last checkpoint on disk is the one to resume from")
        stop_launched()
        os._exit(1)

    def check(self) -> None:
        """Raise Stopped when a stop was requested (a stop point in the loop)."""
        if self.requested.is_set():
            raise Stopped

    async def until(self, work: Awaitable[T]) -> T:
        """`work`'s result, or Stopped (`work` cancelled and awaited) when a stop comes first."""
        if self.requested.is_set():
            if asyncio.iscoroutine(work):
                work.close()  # never started
            raise Stopped
        task = asyncio.ensure_future(work)
        if self._event is None:
            return await task
        waiter = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this coroutine cancelled: so is the work
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stopped
