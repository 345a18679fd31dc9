"""Where torch runs the model: the process's compute thread, with the torch thread count each call
asks for.

torch's CPU ops run on OpenMP (libgomp, bundled in the CPU wheel). Its thread count is per OS
thread, and each OS thread that once ran a parallel region on n > 1 threads keeps a team of n - 1
OpenMP workers for as long as it lives. Once a process's OpenMP workers (and its first thread)
outnumber its CPUs, libgomp throttles its spin-wait between parallel regions to ~100 spins, so
every region after that wakes its workers through the kernel, a context switch per region where
one team has none (measured: docs/benchmarks.md, "One OpenMP team in the process";
bench/bench_omp_teams.py). So the local engines' decoding and the trainer's model work run on one thread,
`compute_thread()`, and the event loop's thread computes on one torch thread while a trainer runs
(`one_thread_here`): the process then has one team.

    compute_thread()               the executor: one worker thread, made on first use, kept for
                                   the process's life (as OpenMP keeps its teams)
    run_with_threads(n, fn, ...)   fn(...) with torch's thread count n in the calling thread,
                                   restored after (0: as it is)
    on_compute(n, fn, ...)         run_with_threads on the compute thread, waited for; inline when
                                   called from the compute thread itself
    one_thread_here()              the calling thread at one torch thread inside, restored after
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_executor: ThreadPoolExecutor | None = None
_made = threading.Lock()
_ident: list[int] = []  # the compute thread's threading.get_ident(), once it has run


def compute_thread() -> ThreadPoolExecutor:
    """The process's one thread for torch work on the model (see the module docstring)."""
    global _executor
    with _made:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="compute",
                initializer=lambda: _ident.append(threading.get_ident()))
        return _executor


def on_compute_thread() -> bool:
    """True in the compute thread."""
    return threading.get_ident() in _ident


def run_with_threads(threads: int, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) with torch's intra-op threads set to `threads` (0: as they are).

    torch's thread count is per OS thread (OpenMP), so it is set here, in the thread that runs
    `fn` -- a count set in the event loop's thread does not reach the threads that run the model."""
    if not threads:
        return fn(*args, **kwargs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def on_compute(threads: int, fn, /, *args, **kwargs):
    """run_with_threads(threads, fn, ...) on the compute thread; the caller waits for it."""
    if on_compute_thread():
        return run_with_threads(threads, fn, *args, **kwargs)
    return compute_thread().submit(run_with_threads, threads, fn, *args, **kwargs).result()


@contextlib.contextmanager
def one_thread_here():
    """The calling thread runs torch ops on one thread inside (no OpenMP team of its own), its
    count restored after. `torch.get_num_threads()` is called once set: it fixes the thread's
    count at 1 (torch copies a process-wide count into a thread on its first parallel op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.get_num_threads()
    try:
        yield before
    finally:
        torch.set_num_threads(before)
