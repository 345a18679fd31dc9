"""The demo over seeds: does the main job learn every time? One run per seed, one at a time
(the machine otherwise idle), each `tracetrain train examples/guess/config.yaml trainer.seed=S`
as a user runs it; printed and written as a table.

    .venv/bin/python bench/bench_demo_seeds.py                      # seeds 0-9
    .venv/bin/python bench/bench_demo_seeds.py --seeds 0 1 2 --out runs/seeds.json

Per seed, from the run's summary.json and metrics.jsonl: the step and minutes at which the
10-step mean training reward first stood +0.3 above the first window (target_gain_step,
target_gain_elapsed_s: from the start of the process, warm start included), the first window,
the best and the last window, and the greedy eval before training and at the end. Then the count
of seeds that crossed within `--minutes`, the median and worst time to cross, and the final gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "guess" / "config.yaml"


def run_seed(seed: int, run_dir: Path, overrides: list[str]) -> dict:
    t = time.monotonic()
    cmd = [sys.executable, "-m", "tracetrain", "train", str(CONFIG), f"trainer.seed={seed}",
           f"trainer.run_dir={run_dir}", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
    return {"seed": seed, "wall_min": (time.monotonic() - t) / 60,
            "cross_step": summary["target_gain_step"],
            "cross_min": None if summary["target_gain_elapsed_s"] is None
            else summary["target_gain_elapsed_s"] / 60,
            "first": summary["reward_first_window"], "best": summary["best_moving_average"],
            "last": summary["reward_last_window"],
            "eval_first": metrics[0].get("eval/initial_reward_mean"),
            "eval_last": evals[-1] if evals else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--minutes", type=float, default=10.0, help="the time limit to cross +0.3")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()
    rows = []
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"cpu: {cpu}; config {CONFIG.relative_to(ROOT)} {' '.join(args.overrides)}", flush=True)
    head = f"{'seed':>4s} {'cross step':>10s} {'cross min':>9s} {'first':>6s} {'best':>6s} " \
           f"{'last':>6s} {'eval 0':>6s} {'eval end':>8s} {'wall min':>8s}"
    print(head, flush=True)
    with tempfile.TemporaryDirectory(prefix="tt-seeds-") as tmp:
        for seed in args.seeds:
            r = run_seed(seed, Path(tmp) / f"seed{seed}", args.overrides)
            rows.append(r)

            def f(x, spec):
                return format(x, spec) if x is not None else "-"

            print(f"{seed:4d} {f(r['cross_step'], '10d')} {f(r['cross_min'], '9.1f')} "
                  f"{r['first']:6.3f} {r['best']:6.3f} {r['last']:6.3f} "
                  f"{f(r['eval_first'], '6.2f')} {f(r['eval_last'], '8.2f')} {r['wall_min']:8.1f}",
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps({"cpu": cpu, "overrides": args.overrides,
                                                "rows": rows}, indent=1))
    crossed = [r["cross_min"] for r in rows if r["cross_min"] is not None]
    within = [m for m in crossed if m <= args.minutes]
    gains = [r["last"] - r["first"] for r in rows]
    print(f"\n{len(within)} of {len(rows)} seeds crossed +0.3 within {args.minutes:g} min "
          f"({len(crossed)} at all)")
    if crossed:
        print(f"time to cross: median {statistics.median(crossed):.1f} min, worst {max(crossed):.1f} min")
    print(f"final gain (last - first window): median {statistics.median(gains):+.3f}, "
          f"min {min(gains):+.3f}; last window below best by at most "
          f"{max(r['best'] - r['last'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
