"""run/memory.py: the peak resident set, its reset, and release_free giving the heap's free pages
back (what a phase freed is then not counted in the later steps' peaks). Each case runs in a fresh
interpreter: the heap and the peak are the process's own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CASE = r"""
import ctypes, ctypes.util, json, sys
from pathlib import Path
from tracetrain.run.memory import peak_rss_gb, release_free, reset_peak

def rss_gb():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024 / 1e9

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = rss_gb()
# 3,000 blocks of 64 KB (under malloc's mmap threshold: they come from the heap), each written,
# then a small block above them so that free() cannot give the heap's top back by itself
blocks = [libc.malloc(64 * 1024) for _ in range(3000)]
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
pin = libc.malloc(64)
held = rss_gb()
for b in blocks:
    libc.free(b)
freed = rss_gb()
if sys.argv[1] == "release":
    release_free()
after = rss_gb()
reset_peak()
print(json.dumps({"before": before, "held": held, "freed": freed, "after": after, "peak": peak_rss_gb()}))
"""


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CASE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc and /proc: Linux only")
def test_release_free_gives_freed_heap_memory_back_and_the_peak_resets_to_it():
    block_gb = 3000 * 64 * 1024 / 1e9  # 0.197
    kept, released = run("keep"), run("release")
    for r in (kept, released):
        assert r["held"] - r["before"] > 0.9 * block_gb  # the blocks were resident
    # free() alone keeps them in the heap (resident); release_free returns them
    assert kept["after"] - kept["before"] > 0.9 * block_gb
    assert released["freed"] - released["before"] > 0.9 * block_gb
    assert released["after"] - released["before"] < 0.1 * block_gb
    # after a reset, the peak is the resident set of that moment, not the earlier high-water mark
    assert released["peak"] < released["held"] - 0.8 * block_gb
    assert kept["peak"] > kept["held"] - 0.1 * block_gb
