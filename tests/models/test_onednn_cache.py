"""`import tracetrain` bounds oneDNN's primitive caches (tracetrain/__init__.py): a process that runs
bf16 matmuls of many shapes (packed rows of a new length every step) stops growing at the cap."""

import json
import os
import subprocess
import sys

import pytest

# 1,200 bf16 matmuls, each of a new shape (M = 1..1200 rows): the resident set's growth, in MB.
GROWTH = """
import json, os, sys
{imports}
import torch
torch.set_num_threads(1)
def rss_mb():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1e3
w = torch.randn(256, 256, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(8, 256, dtype=torch.bfloat16), w)
before = rss_mb()
for m in range(1, 1201):
    torch.nn.functional.linear(torch.randn(m, 256, dtype=torch.bfloat16), w)
print(json.dumps({{"growth_mb": rss_mb() - before,
                  "caps": [os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                           os.environ.get("LRU_CACHE_CAPACITY")]}}))
"""


def _growth(imports: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", GROWTH.format(imports=imports)], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_sets_the_caps_and_a_users_own_value_wins():
    assert _growth("import tracetrain")["caps"] == ["128", "128"]
    mine = _growth("import tracetrain", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1000", LRU_CACHE_CAPACITY="7")
    assert mine["caps"] == ["1000", "7"]


def test_capped_caches_hold_less_than_the_default():
    """Without tracetrain the 1,200 shapes fill the default 1,024 entries (~0.6 MB each where oneDNN
    runs bf16 matmuls); imported first, tracetrain keeps 128 of them: under half the growth."""
    plain = _growth("")
    assert plain["caps"] == [None, None]
    if plain["growth_mb"] < 200:
        pytest.skip(f"bf16 matmuls here do not go through oneDNN's caches "
                    f"(1,200 shapes grew the process by {plain['growth_mb']:.0f} MB)")
    capped = _growth("import tracetrain")
    assert capped["growth_mb"] < plain["growth_mb"] / 2, (capped, plain)
