"""Outcome-only credit vs credit per turn on examples/guess/checker.yaml, side by side.

    .venv/bin/python bench/bench_credit.py [--seeds 0 1 2] [--steps 100] [--gain 0.2]
                                           [--arms grpo return-to-go] [--out runs/bench-credit]
                                           [--set KEY=VALUE ...]   (config overrides, both arms)

The two-role game (a guesser that trains, a checker served by a frozen copy; a turn reward of
+-0.2 per guess as it is made) trained once per (arm, seed), the arms interleaved seed by seed so
that a shared machine's load falls on both alike. Arms: `grpo` (the rollout's advantage from its
final reward alone: outcome-only credit; the turn rewards are recorded and unused) and
`return-to-go` (each guess its own advantage: its turn rewards from it on, discounted by
advantage.gamma of the config, plus the final reward, normalised in its group). Everything else is
the config's. Per run, from its summary.json: the untrained policy's reward (its own rollouts),
the step and minutes (since the start, warm start included) at which the 10-step mean reward first
reached it + `--gain`, the last 10-step mean, and the greedy eval at the end. Then each arm's
median over seeds and the ratio of steps to the gain. Whether turn credit learns faster is what
this measures; the answer goes in docs/benchmarks.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "guess" / "checker.yaml"


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(arm: str, seed: int, steps: int, gain: float, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{arm}-s{seed}"
    cmd = [sys.executable, "-m", "tracetrain", "train", str(CONFIG), f"advantage.estimator={arm}",
           f"trainer.seed={seed}", f"trainer.steps={steps}", f"trainer.target_gain={gain}",
           f"trainer.run_dir={run_dir}", "trainer.resume=false", *extra]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    return {"arm": arm, "seed": seed, "untrained": s.get("reward_untrained"),
            "gain_step": s.get("untrained_gain_step"),
            "gain_min": None if s.get("untrained_gain_elapsed_s") is None
            else s["untrained_gain_elapsed_s"] / 60,
            "last_window": s["reward_last_window"], "eval_last": evals[-1] if evals else None,
            "wall_min": wall / 60}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--gain", type=float, default=0.2)
    p.add_argument("--arms", nargs="+", default=["grpo", "return-to-go"])
    p.add_argument("--out", default="runs/bench-credit")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for both arms, e.g. rollout.tasks_per_step=8")
    a = p.parse_args()
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"{CONFIG.relative_to(ROOT)}, {a.steps} steps, gain +{a.gain} over the untrained reward; "
          f"{cpu()}" + (f"; overrides {' '.join(a.set)}" if a.set else ""))
    rows = []
    for seed in a.seeds:
        for arm in a.arms:
            r = run(arm, seed, a.steps, a.gain, out, a.set)
            rows.append(r)
            print(f"  {arm:13s} seed {seed}: untrained {fmt(r['untrained'], '.3f')}, +{a.gain} at "
                  f"step {fmt(r['gain_step'], 'd')} ({fmt(r['gain_min'], '.1f')} min), last window "
                  f"{r['last_window']:.3f}, eval {fmt(r['eval_last'], '.3f')}, "
                  f"run {r['wall_min']:.1f} min", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print("median over seeds (a run that never reached the gain counts as --steps):")
    med = {}
    for arm in a.arms:
        mine = [r for r in rows if r["arm"] == arm]
        steps = [r["gain_step"] if r["gain_step"] is not None else a.steps for r in mine]
        reached = sum(r["gain_step"] is not None for r in mine)
        med[arm] = statistics.median(steps)
        minutes = [r["gain_min"] for r in mine if r["gain_min"] is not None]
        evals = [r["eval_last"] for r in mine if r["eval_last"] is not None]
        print(f"  {arm:13s} steps to the gain {med[arm]:.0f} ({reached}/{len(mine)} reached), "
              f"minutes {fmt(statistics.median(minutes) if minutes else None, '.1f')}, last window "
              f"{statistics.median(r['last_window'] for r in mine):.3f}, eval "
              f"{fmt(statistics.median(evals or [0]), '.3f')}")
    if len(a.arms) == 2 and med[a.arms[1]]:
        print(f"steps to the gain, {a.arms[0]} / {a.arms[1]}: {med[a.arms[0]] / med[a.arms[1]]:.2f}")


if __name__ == "__main__":
    main()
