"""What oneDNN's primitive caches hold: 1,200 bf16 matmuls, each of a new shape (M = 1..1200 rows of
a 256 x 256 weight, the way packed rows change length every step), in a fresh process per cache
capacity; printed: the resident set's growth (MB) and the loop's seconds.

    .venv/bin/python bench/bench_onednn_cache.py                  # 1024 (oneDNN's default), 256, 128, 64
    .venv/bin/python bench/bench_onednn_cache.py --caps 1024 128

Each capacity is set in both caches (ONEDNN_PRIMITIVE_CACHE_CAPACITY, and LRU_CACHE_CAPACITY, the
cache of PyTorch's ideep layer) before the process runs a matmul; tracetrain sets 128 when imported
(tracetrain/__init__.py). On a CPU whose bf16 matmuls do not go through oneDNN the growth is ~0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CAPS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CHILD = """
import json, os, time
{imports}
import torch
torch.set_num_threads(1)
def rss_mb():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1e3
w = torch.randn(256, 256, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(8, 256, dtype=torch.bfloat16), w)
before, t = rss_mb(), time.perf_counter()
for m in range(1, 1201):
    torch.nn.functional.linear(torch.randn(m, 256, dtype=torch.bfloat16), w)
print(json.dumps({{"growth_mb": rss_mb() - before, "s": time.perf_counter() - t,
                  "caps": [os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                           os.environ.get("LRU_CACHE_CAPACITY")]}}))
"""


def growth(imports: str = "", **caps: str) -> dict:
    """The child's figures: {growth_mb, s, caps (the two variables as the child saw them)}, run
    after `imports` with the environment less both variables, plus `caps` (by variable name)."""
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    out = subprocess.run([sys.executable, "-c", CHILD.format(imports=imports)], env={**env, **caps},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[1024, 256, 128, 64])
    args = ap.parse_args()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores, 1 thread; 1,200 shapes")
    for cap in args.caps:
        r = growth(**dict.fromkeys(CAPS, str(cap)))
        print(f"capacity {cap:5d}: +{r['growth_mb']:6.0f} MB ({r['growth_mb'] / min(cap, 1200):.2f} MB "
              f"an entry), {r['s']:.2f} s")


if __name__ == "__main__":
    main()
