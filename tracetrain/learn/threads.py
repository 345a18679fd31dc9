"""Torch's thread count where the model runs: it is per OS thread (OpenMP), so the trainer sets it
in the thread that runs the warm start, the updates and the engine's decoding."""

from __future__ import annotations

import torch


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
