"""The calculator at its shipped config (examples/calculator/config.yaml), timed step by step.

    .venv/bin/python bench/bench_calculator.py --steps 20
    .venv/bin/python bench/bench_calculator.py --steps 20 trainer.update_threads=2
    .venv/bin/python bench/side_by_side.py 580f14f --rounds 1 -- bench/bench_calculator.py --steps 20

Runs `tracetrain train examples/calculator/config.yaml` in the tree it is started from (the
config that tree ships, its seed), with only the length changed: trainer.steps --steps, no eval
pass (trainer.eval_every 0), a temporary run_dir. Reads the run's metrics.jsonl and prints each
step's seconds (the difference of time/elapsed_s between steps: the first step counts from the
run's start, so its model load and the first collect are in it and it is left out of the
median), the median and mean step, the mean training reward over the steps, the engine-trainer
logprob gap, the medians of a step's parts (PARTS, and the update's phases time/update/*), each
step's resident peak and the wall seconds of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# a step's parts (with trainer.collect overlap the next step's collect runs beside the update)
PARTS = ("time/collect_s", "time/update_s", "time/sync_s", "time/rows_s", "engine/prefix_hit_rate",
         "engine/idle_frac", "time/update_idle_frac")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="trainer.steps")
    ap.add_argument("--config", default="examples/calculator/config.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY=VALUE (as tracetrain train)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-calculator-") as tmp:
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "tracetrain", "train", args.config, f"trainer.steps={args.steps}",
             "trainer.eval_every=0", f"trainer.run_dir={tmp}/run", *args.overrides],
            capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    elapsed = [m["time/elapsed_s"] for m in lines]
    steps = [b - a for a, b in zip([0.0] + elapsed[:-1], elapsed, strict=True)]
    rewards = [m["reward_mean"] for m in lines if "reward_mean" in m]
    gap = [m["engine/logprob_gap_mean"] for m in lines if "engine/logprob_gap_mean" in m]
    print(f"config {args.config} {' '.join(args.overrides)}, {len(lines)} steps, wall {wall:.0f} s "
          "(model load included)")
    print("step seconds: " + " ".join(f"{s:.1f}" for s in steps))
    print(f"median step (steps 1..): {statistics.median(steps[1:]):.2f} s, mean "
          f"{statistics.mean(steps[1:]):.2f} s; first step {steps[0]:.1f} s")
    print(f"training reward mean over the steps: {statistics.mean(rewards):.3f} (first 5: "
          f"{statistics.mean(rewards[:5]):.3f}, last 5: {statistics.mean(rewards[-5:]):.3f})")
    if gap:
        print(f"engine-trainer logprob gap, mean over steps: {statistics.mean(gap):.2e}")
    phases = sorted({k for m in lines for k in m if k.startswith("time/update/")})
    parts = {k: [m[k] for m in lines[1:] if k in m] for k in (*PARTS, *phases)}
    print("median over steps 1..: " + ", ".join(
        f"{k} {statistics.median(v):.2f}" for k, v in parts.items() if v))
    peaks = [m["memory/peak_rss_gb"] for m in lines if "memory/peak_rss_gb" in m]
    if peaks:
        print("each step's peak resident GB: " + " ".join(f"{x:.2f}" for x in peaks))


if __name__ == "__main__":
    main()
