"""One shared policy or two: the guesser and the checker of examples/guess/two_policies.yaml, trained
(a) `shared`: one LoRA adapter making both roles' calls, (b) `two`: two adapters, one per role,
(c) `whole`: the guesser an adapter, the checker a whole model of its own (whole_checker.yaml);
each `tracetrain train` as a user runs it, over seeds, one run at a time, side by side.

    .venv/bin/python bench/bench_policies.py                         # seeds 0 1 2, 60 steps
    .venv/bin/python bench/bench_policies.py --seeds 0 --steps 20 --arms two whole --out runs/bench-policies

Every run starts from one warm-started base (made once per --out: the example's warm start, both
roles' formats), so the two arms differ only in how many policies learn. Per run, from
metrics.jsonl: the game's reward (first and last 10-step window, the step and minutes at which the
window first stood +--gain above the first), each role's own reward (the guesser's turn reward,
the checker's verdict accuracy = (turn reward / c + 1) / 2 with c = task_args.check_reward), step
time, peak memory. Whether two policies learn faster is what this measures, not what it assumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GUESS = ROOT / "examples" / "guess"
CONFIG = GUESS / "two_policies.yaml"
CHECK_REWARD = 0.5  # (task_args.check_reward of two_policies.yaml)
WINDOW = 10
# arm (a): one adapter (the guesser's settings) making both roles' calls
SHARED = {"shared": {"roles": ["guesser", "checker"], "lora": {"r": 16, "alpha": 32}, "lr": 2.0e-3}}


def run(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with log.open("ab") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=GUESS)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}): see {log}")
    return time.perf_counter() - t


def warm_base(out: Path, log: Path) -> Path:
    """The example's warm start (400 supervised steps on both roles' transcripts), once."""
    folder = out / "warm"
    if not (folder / "policy" / "config.json").is_file():
        run([sys.executable, "-m", "tracetrain", "train", str(GUESS / "checker.yaml"),
             "trainer.steps=1", "trainer.eval_every=0", f"trainer.run_dir={folder}"], log)
    return folder / "policy"


def window(xs: list[float], at: int) -> float:
    part = [x for x in xs[at:at + WINDOW] if x == x]
    return sum(part) / len(part) if part else float("nan")


def first_gain(xs: list[float], gain: float) -> int | None:
    """The first step whose trailing WINDOW-step mean is >= the first window's + gain."""
    start = window(xs, 0)
    for k in range(WINDOW - 1, len(xs)):
        if window(xs, k - WINDOW + 1) >= start + gain - 1e-9:
            return k
    return None


def measure(run_dir: Path, gain: float) -> dict:
    ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = [m["reward_mean"] for m in ms]
    guess = [m.get("roles/guesser/turn_reward_mean", float("nan")) for m in ms]
    right = [(m.get("roles/checker/turn_reward_mean", float("nan")) / CHECK_REWARD + 1) / 2 for m in ms]
    hit = first_gain(reward, gain)
    n = len(ms)
    return {
        "reward_first": window(reward, 0), "reward_last": window(reward, n - WINDOW),
        "gain_step": hit, "gain_minutes": None if hit is None else ms[hit]["time/elapsed_s"] / 60,
        "guesser_turn_reward_first": window(guess, 0), "guesser_turn_reward_last": window(guess, n - WINDOW),
        "checker_right_first": window(right, 0), "checker_right_last": window(right, n - WINDOW),
        "step_s": statistics.median(m["time/collect_s"] + m["time/train_s"] for m in ms),
        "peak_rss_gb": max(m.get("memory/peak_rss_gb", 0.0) for m in ms),
        "minutes": ms[-1]["time/elapsed_s"] / 60,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gain", type=float, default=0.15, help="the game reward's gain that counts")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-policies")
    ap.add_argument("--arms", nargs="+", default=["shared", "two", "whole"],
                    choices=["shared", "two", "whole"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    base = warm_base(args.out, log)
    shared = yaml.safe_load(CONFIG.read_text())
    shared.update(task=str(GUESS / "task.py"), policies=SHARED)
    (args.out / "shared.yaml").write_text(yaml.safe_dump(shared))
    arms = {"shared": args.out / "shared.yaml", "two": CONFIG, "whole": GUESS / "whole_checker.yaml"}
    arms = {arm: arms[arm] for arm in args.arms}
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in args.seeds:
        for arm, config in arms.items():  # (interleaved: the machine's drift hits both arms alike)
            run_dir = args.out / f"{arm}-seed{seed}"
            run([sys.executable, "-m", "tracetrain", "train", str(config),
                 "model.kind=pretrained", f"model.path={base}", "warm_start.steps=0",
                 f"trainer.seed={seed}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
                 f"trainer.run_dir={run_dir}"], log)
            results[arm].append({"seed": seed, **measure(run_dir, args.gain)})
            print(json.dumps({"arm": arm, **results[arm][-1]}), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    keys = [k for k in next(iter(results.values()))[0] if k != "seed"]
    table = {arm: {k: statistics.median(r[k] for r in rs if r[k] is not None)
                   if any(r[k] is not None for r in rs) else None for k in keys}
             for arm, rs in results.items()}
    for arm, rs in results.items():
        table[arm]["seeds_reaching_gain"] = sum(r["gain_step"] is not None for r in rs)
    out = {"cpu": cpu, "steps": args.steps, "seeds": args.seeds, "gain": args.gain,
           "median": table, "runs": results}
    (args.out / "bench_policies.json").write_text(json.dumps(out, indent=2))
    print(json.dumps({"cpu": cpu, "median": table}, indent=2))


if __name__ == "__main__":
    main()
