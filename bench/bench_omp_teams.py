"""What a second OS thread's OpenMP team costs a thread that runs the model (issue 46, a finding).

    .venv/bin/python bench/bench_omp_teams.py            # 2 torch threads per team

torch's intra-op threads are OpenMP's, and OpenMP keeps a team per OS thread that ran a parallel
region. tracetrain runs torch in three OS threads (the main thread loads the model, the local
engine decodes in its own thread, the trainer updates in another: run/update_thread.py
UpdateThread). This bench times one "layer pass" (--layers x: a [32, 576] @ [576, 1536] bf16
matmul, then a softmax over its float32 result: a decode step's shapes, 2 parallel regions each)
in a worker thread, in fresh processes:

    alone            nothing else in the process ever ran a multi-threaded region
    after main       the main thread ran the same passes first (its team of --threads exists)
    second worker    another worker thread, still alive, ran them first (its team exists)

and prints the best of --repeats passes of each. With libgomp, more OpenMP threads than CPUs make
every team stop spinning between regions almost at once (GOMP_SPINCOUNT's throttled count), so
each region pays a futex wake-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def child(case: str, threads: int, layers: int, repeats: int) -> float:
    import torch

    torch.set_num_threads(threads if case == "after main" else 1)
    weights = [torch.randn(576, 1536, dtype=torch.bfloat16) for _ in range(layers)]
    x = torch.randn(32, 576, dtype=torch.bfloat16)

    def passes() -> float:
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for w in weights:
                torch.softmax((x @ w).float(), -1)
            best = min(best, time.perf_counter() - t)
        return best

    if case == "after main":
        passes()
    first = ThreadPoolExecutor(1)  # (kept alive, its thread and team with it, as tracetrain's are)
    if case == "second worker":
        first.submit(passes).result()
    return ThreadPoolExecutor(1).submit(passes).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads, args.layers, args.repeats)))
        return
    seconds = {}
    for case in ("alone", "after main", "second worker"):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--threads",
                              str(args.threads), "--layers", str(args.layers), "--repeats",
                              str(args.repeats)], capture_output=True, text=True, check=True)
        seconds[case] = json.loads(out.stdout.strip().splitlines()[-1])
    for case, s in seconds.items():
        print(f"{case:14s} {s * 1e3:7.1f} ms   {s / seconds['alone']:.2f}x alone")


if __name__ == "__main__":
    main()
