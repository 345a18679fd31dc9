"""The process's peak resident memory, per step (Linux: VmHWM, reset through /proc/self/clear_refs).

    reset_peak()     peak := current resident set (writes "5" to /proc/self/clear_refs)
    peak_rss_gb()    the peak since the last reset (or since the start), in GB (10^9 bytes)
    release_free()   the C heap's free memory given back to the system (glibc's malloc_trim)

Where /proc is not there (macOS) the peak is the process's lifetime maximum (getrusage) and a reset
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_gb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def release_free() -> None:
    """glibc keeps the memory a phase freed (the warm start's optimizer, activations and engine
    caches) in its heap, counted in the resident set of every later step; malloc_trim(0) returns
    the free pages to the system (after the warm start and after each step: on the calculator it
    gives back ~1.1 GB a step in ~0.1 s, docs/benchmarks.md). Nothing where the C library is not
    glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
