"""The demo's step time under its speed settings, side by side: the same warm-started policy, the
same steps, one setting changed at a time.

    .venv/bin/python bench/bench_demo_step.py                  # 12 steps per variant, 2 rounds
    .venv/bin/python bench/bench_demo_step.py --steps 20 --rounds 3

Variants (all on examples/guess/config.yaml, 16 tasks x 8 rollouts, 2 mini-batches + KL):
  fp32 sequential        trainer.precision=fp32, collect then update (the engine shares the weights)
  bf16-mixed sequential  trainer.precision=bf16-mixed, collect then update
  bf16-mixed overlap     bf16-mixed + trainer.collect overlap (the demo's config; its batches in
                         lockstep, trainer.reproducible)
  ..., by arrival        the same with trainer.reproducible=false: batches close after a quiet
                         engine.batch_window_ms (what reproducibility costs)

One warm start is done first (`tracetrain train ... trainer.steps=1`); every variant resumes from
that checkpoint in its own run directory and trains `--steps` more steps (eval off). Each variant
runs `--rounds` times, interleaved (A B C A B C), because the shared VM's speed drifts. Printed per
variant: the median over steps of the step's wall time (from `time/elapsed_s`), collect and update
seconds, the best round, and the ratio of each variant's best round to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "guess" / "config.yaml"
VARIANTS = {
    "fp32 sequential": ["trainer.precision=fp32", "trainer.collect=step",
                        "trainer.update_threads=2"],
    "bf16-mixed sequential": ["trainer.precision=bf16-mixed", "trainer.collect=step",
                              "trainer.update_threads=2"],
    "bf16-mixed overlap": ["trainer.precision=bf16-mixed", "trainer.collect=overlap",
                           "trainer.max_staleness=1"],
    "bf16-mixed overlap, by arrival": ["trainer.precision=bf16-mixed", "trainer.collect=overlap",
                                       "trainer.max_staleness=1", "trainer.reproducible=false"],
}


def train(run_dir: Path, steps: int, overrides: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "tracetrain", "train", str(CONFIG), f"trainer.steps={steps}",
           f"trainer.run_dir={run_dir}", "trainer.eval_every=0", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(metrics: list[dict]) -> dict:
    """Medians over the steps of one run (the first step after the resume is left out: it pays
    for the agent workers' start-up)."""
    ms = metrics[1:]
    walls = [b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in zip(ms, ms[1:], strict=False)]
    return {
        "step_s": statistics.median(walls),
        "collect_s": statistics.median(m["time/collect_s"] for m in ms),
        "update_s": statistics.median(m.get("time/update_s", 0.0) for m in ms),
    }


def run_rounds(variants: dict[str, list[str]], steps: int, rounds: int, summarize=summarize,
               describe=lambda s: f"update {s['update_s']:.3f} s") -> dict[str, list[dict]]:
    """One warm start; then `rounds` times, interleaved (A B C A B C), each variant resumed from
    that checkpoint in its own run directory for `steps` more steps; `summarize` of each run,
    printed as it ends (step, collect, then `describe`)."""
    width = max(map(len, variants))
    with tempfile.TemporaryDirectory(prefix="tt-demo-step-") as tmp:
        work = Path(tmp)
        print("warm start ...", flush=True)
        train(work / "warm", 1, [])
        results: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(rounds):
            for name, overrides in variants.items():
                run = work / f"{name.replace(' ', '-')}-{r}"
                run.mkdir()
                shutil.copy(work / "warm" / "checkpoint.pt", run / "checkpoint.pt")
                s = summarize(train(run, 1 + steps, ["trainer.resume=true", *overrides]))
                results[name].append(s)
                print(f"  round {r + 1} {name:{width}s} step {s['step_s']:.3f} s  "
                      f"collect {s['collect_s']:.3f} s  {describe(s)}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    metavar="VARIANT", help="run these variants (default: all)")
    args = ap.parse_args()
    results = run_rounds({k: VARIANTS[k] for k in args.only}, args.steps, args.rounds)
    base = min(s["step_s"] for s in results[args.only[0]])
    print(f"\n{args.steps} steps per run, {args.rounds} rounds; medians over steps, best round shown")
    print(f"{'variant':24s} {'step s':>8s} {'collect s':>10s} {'update s':>9s} {'speed-up':>9s}")
    for name, rows in results.items():
        best = min(rows, key=lambda s: s["step_s"])
        print(f"{name:24s} {best['step_s']:8.3f} {best['collect_s']:10.3f} {best['update_s']:9.3f} "
              f"{base / best['step_s']:8.2f}x")


if __name__ == "__main__":
    main()
