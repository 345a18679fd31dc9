"""The process's peak resident memory, per step (Linux: VmHWM, reset through /proc/self/clear_refs).

    reset_peak()     peak := current resident set (writes "5" to /proc/self/clear_refs)
    peak_rss_gb()    the peak since the last reset (or since the start), in GB (10^9 bytes)

Where /proc is not there (macOS) the peak is the process's lifetime maximum (getrusage) and a reset
does nothing.
"""

from __future__ import annotations

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
