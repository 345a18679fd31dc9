"""Continuous vs step-synchronous collection on the demo, with rollouts of very uneven length.

    .venv/bin/python bench/bench_continuous.py --minutes 4 --out runs/continuous

examples/guess/config.yaml with task_args slow_every=4, slow_s=1: every 4th task's environment
answers each guess after 1 s, so its rollouts take ~5x as long as the others. The warm start runs
once (OUT/warm/policy); every arm starts from it (model.kind pretrained) and trains for the same
wall-clock minutes, then is stopped:

    step          trainer.collect step: each step waits for its slowest rollout
    continuous-1  trainer.collect continuous, max_staleness 1
    continuous-2  trainer.collect continuous, max_staleness 2

All arms: the agents in the trainer's process (rollout.agent_workers 0: continuous collection
refuses worker processes), collect step, no eval passes, the demo's other settings. The
arms run one after another, alone on the machine. Printed side by side: rollouts trained per
second and its ratio to `step`, the engine's idle fraction (wall time with no request in flight),
the steps done, the largest staleness, and the reward against wall time (the mean training reward
of the steps ending in each minute; all arms sample at temperature 1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "guess" / "config.yaml"
ARMS = {
    "step": ["trainer.collect=step"],
    "continuous-1": ["trainer.collect=continuous", "trainer.max_staleness=1"],
    "continuous-2": ["trainer.collect=continuous", "trainer.max_staleness=2"],
}


def warm(out: Path, common: list[str]) -> Path:
    """The demo's warm start, once: OUT/warm/policy."""
    from tracetrain.agents.tasks import load_task
    from tracetrain.config import load_config
    from tracetrain.learn.warmstart import warm_start
    from tracetrain.models.load import load_policy
    from tracetrain.run import checkpoint

    path = out / "warm" / "policy"
    if (path / "config.json").is_file():
        return path
    cfg = load_config(CONFIG, common)
    task = load_task(cfg.task, CONFIG.parent)
    model, tokenizer = load_policy(cfg.model, seed=cfg.trainer.seed)
    ws = cfg.warm_start
    transcripts = task.warm_start_transcripts(ws.steps * ws.batch_size, seed=cfg.trainer.seed,
                                              **cfg.task_args)
    t = time.perf_counter()
    losses = warm_start(model, tokenizer, transcripts, steps=ws.steps, batch_size=ws.batch_size,
                        lr=ws.lr, seed=cfg.trainer.seed, precision=cfg.trainer.precision)
    print(f"warm start: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.perf_counter() - t:.0f} s")
    return checkpoint.write_policy(model, tokenizer, path)


def metrics(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []


def train_for(run: Path, overrides: list[str], seconds: float) -> list[dict]:
    """`tracetrain train` until a step ends past `seconds` of its run (time/elapsed_s), then
    stopped; the steps that ended within the budget."""
    log = run.with_suffix(".log")
    run.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tracetrain", "train", str(CONFIG), *overrides,
                                 f"trainer.run_dir={run}"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            while proc.poll() is None:
                time.sleep(2)
                done = metrics(run)
                if done and done[-1]["time/elapsed_s"] > seconds:
                    break
        finally:
            proc.kill()
            proc.wait()
    return [m for m in metrics(run) if m["time/elapsed_s"] <= seconds]


def summary(steps: list[dict], per_step: int, seconds: float) -> dict:
    if not steps:
        return {"steps": 0}
    ends = [m["time/elapsed_s"] for m in steps]
    spans = [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]
    busy = sum((1 - m["engine/idle_frac"]) * s for m, s in zip(steps, spans, strict=True))
    ages = [int(k.rsplit("_", 1)[1]) for m in steps for k in m if k.startswith("staleness/tokens_")]
    minutes = {}
    for m in steps:
        minutes.setdefault(int(m["time/elapsed_s"] // 60), []).append(m["reward_mean"])
    return {"steps": len(steps), "rollouts_per_s": len(steps) * per_step / seconds,
            "engine_idle": 1 - busy / steps[-1]["time/elapsed_s"], "max_staleness": max(ages),
            "mixed_version_rollouts": sum(m.get("staleness/mixed_version_rollouts", 0) for m in steps),
            "reward_by_minute": {k: sum(v) / len(v) for k, v in sorted(minutes.items())},
            "reward_last_10": sum(m["reward_mean"] for m in steps[-10:]) / len(steps[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each arm")
    ap.add_argument("--out", type=Path, default=Path("runs/continuous"))
    ap.add_argument("--slow-every", type=int, default=4)
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    out = args.out.resolve()
    common = [f"task_args.slow_every={args.slow_every}", f"task_args.slow_s={args.slow_s}"]
    policy = warm(out, common)
    from tracetrain.config import load_config

    cfg = load_config(CONFIG, [])
    per_step = cfg.rollout.tasks_per_step * cfg.rollout.n_per_task
    seconds = args.minutes * 60
    base = [*common, "model.kind=pretrained", f"model.path={policy}", "warm_start.steps=0",
            "rollout.agent_workers=0", "trainer.collect=step", "trainer.max_staleness=0",
            "trainer.eval_every=0", "trainer.steps=100000", "trainer.checkpoint_every=0"]
    results = {}
    for name in args.arms:
        run = out / name
        if run.exists():
            import shutil

            shutil.rmtree(run)
        t = time.strftime("%H:%M:%S")
        results[name] = summary(train_for(run, base + ARMS[name], seconds), per_step, seconds)
        print(f"{t} {name}: {json.dumps(results[name])}", flush=True)
    ref = results.get("step", {}).get("rollouts_per_s")
    print(f"\n{'arm':<14} {'steps':>6} {'rollouts/s':>11} {'x step':>7} {'engine idle':>12} "
          f"{'max stale':>10} {'reward last 10':>15}  reward by minute")
    for name, r in results.items():
        if not r["steps"]:
            print(f"{name:<14} no step within the budget")
            continue
        ratio = f"{r['rollouts_per_s'] / ref:.2f}" if ref else "-"
        by_minute = " ".join(f"{v:.2f}" for v in r["reward_by_minute"].values())
        print(f"{name:<14} {r['steps']:>6} {r['rollouts_per_s']:>11.1f} {ratio:>7} "
              f"{r['engine_idle']:>12.2f} {r['max_staleness']:>10} {r['reward_last_10']:>15.3f}  {by_minute}")
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
