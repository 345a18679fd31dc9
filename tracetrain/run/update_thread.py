"""Where a run's model work outside the engine runs (the update, the warm start, a precision
measurement): the compute thread, where the local engine decodes, when collection waits for the
update (collect "step": they take turns, one OpenMP team: models/compute.py); an own thread when
the engine decodes during the update (collect "overlap", "continuous")."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from tracetrain.learn.update import UpdateStopped
from tracetrain.models.compute import compute_thread, run_with_threads
from tracetrain.run.stop import Stopped


class UpdateThread:
    """`run(threads, fn, ...)`: fn on the update's thread with `threads` torch threads;
    `threads` the engine's count, `update_threads` the update's (trainer.update_threads)."""

    def __init__(self, collect: str, threads: int, update_threads: int):
        self.own = collect != "step"
        self.threads, self.update_threads = threads, update_threads
        self.executor: ThreadPoolExecutor | None = None

    async def run(self, threads: int, fn, /, *args, **kwargs):
        """fn(*args, **kwargs) with `threads` torch threads, on the update's thread."""
        executor = compute_thread() if not self.own else self.executor
        if executor is None:
            executor = self.executor = ThreadPoolExecutor(1, thread_name_prefix="update")
        return await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(run_with_threads, threads, fn, *args, **kwargs))

    async def update(self, fn, /, *args, **kwargs):
        """An optimizer update with the update's threads; a stop it honoured (UpdateStopped)
        raises Stopped (run/stop.py)."""
        try:
            return await self.run(self.update_threads, fn, *args, **kwargs)
        except UpdateStopped:
            raise Stopped from None

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)
            self.executor = None
