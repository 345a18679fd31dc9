"""Chaos: kill a training run at random moments, resume it each time, and check that nothing was
lost or repeated and that it ends where an uninterrupted run ends.

    reference   the run straight through (same config, seed and threads)
    chaos       `tracetrain train ... trainer.resume=true` started, killed after a random delay
                (SIGKILL, or SIGTERM: then the time to exit and the exit code are measured),
                N times; then started once more and left to finish
    checks      metrics.jsonl: every step once, in order; continuous: every group (s<step>-t<j>)
                trained once across all the processes; the newest checkpoint verifies and loads;
                traces.db passes `PRAGMA integrity_check`; per step, the chaos run's metrics
                against the reference's (rewards, rows, loss) and the final weights (max |diff|);
                continuous: the largest staleness trained, and how far a second uninterrupted run
                is from the first (continuous collection is not deterministic: its noise floor)

    .venv/bin/python bench/chaos.py --mode step --signal kill --kills 20
    .venv/bin/python bench/chaos.py --mode continuous --signal term --kills 20
    .venv/bin/python bench/chaos.py --kills 2 --steps 6 --warm-steps 5  # the short one (a test runs it)

Prints one JSON object (and writes it to OUT/chaos-<mode>-<signal>.json). The run is the guess
demo (its task and model, warm-started once into OUT/warm-N/policy) with small steps, so that the
kills land in every phase of a step: collection, the update, a checkpoint write, an eval, between
steps and during start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GUESS = ROOT / "examples" / "guess"
# Not compared: the measured times, and the engine's work counters (a resumed process's engine
# starts with an empty prefix cache, so it may prefill a few more tokens: how, not what, it samples)
TIME_KEYS = ("time/", "rollouts_per_s", "trained_tokens_per_s", "memory/", "engine/idle_frac",
             "collect/take_wait_s", "throughput", "engine/forward_calls", "engine/prefill_tokens",
             "engine/prefix_cache_tokens", "engine/batches", "engine/requests")


COMMON = ["rollout.agent_workers=0", "trainer.precision=fp32", "engine.threads=1",
          "trainer.update_threads=1", "trainer.collect=step"]


def warm_policy(folder: Path, log: Path, steps: int) -> Path:
    """The demo's model after a short warm start (it plays the game's format; reward > 0), made
    once: every run here starts from it, so a kill may land anywhere in the RL loop."""
    if not (folder / "policy" / "config.json").is_file():
        finish([sys.executable, "-m", "tracetrain", "train", str(GUESS / "config.yaml"), *COMMON,
                f"warm_start.steps={steps}", "warm_start.batch_size=32", "trainer.steps=1",
                "trainer.eval_every=0", f"trainer.run_dir={folder}"], log, 1800)
    return folder / "policy"


def config(run_dir: Path, policy: Path, args: argparse.Namespace) -> list[str]:
    """The command line of one process of the run (the guess demo's task and model, warm)."""
    mode = ["trainer.collect=continuous", "trainer.max_staleness=1"] if args.mode == "continuous" else []
    return [sys.executable, "-m", "tracetrain", "train", str(GUESS / "config.yaml"), *COMMON,
            "model.kind=pretrained", f"model.path={policy}", "warm_start.steps=0",
            "rollout.tasks_per_step=3", "rollout.n_per_task=4", "optim.warmup_steps=0",
            f"trainer.steps={args.steps}", f"trainer.seed={args.seed}",
            "trainer.eval_every=3", "trainer.eval_tasks=8", f"trainer.checkpoint_every={args.every}",
            f"trainer.run_dir={run_dir}", "trainer.resume=true", *mode]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def finish(cmd: list[str], log: Path, timeout_s: float) -> float:
    t = time.perf_counter()
    proc = start(cmd, log)
    if proc.wait(timeout_s) != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}): see {log}")
    return time.perf_counter() - t


def kill_once(cmd: list[str], log: Path, delay_s: float, sig: int, grace_s: float) -> dict:
    """Start a process of the run, send `sig` after `delay_s`; -> what happened."""
    proc = start(cmd, log)
    try:
        proc.wait(delay_s)
        return {"delay_s": delay_s, "finished_first": True, "rc": proc.returncode}
    except subprocess.TimeoutExpired:
        pass
    t = time.perf_counter()
    proc.send_signal(sig)
    try:
        rc = proc.wait(grace_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        return {"delay_s": delay_s, "rc": rc, "hung": True}
    return {"delay_s": delay_s, "rc": rc, "exit_s": time.perf_counter() - t}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    from tracetrain.run import checkpoint

    return checkpoint.load(run_dir / "checkpoint.pt")["model"]


def compare(got: list[dict], want: list[dict], run: Path, ref: Path) -> dict:
    """How far run `got` is from run `want`: steps with the same rewards and rows, the largest
    loss and final-weight differences, and whether every metric but the times is the same."""
    same = ("reward_mean", "aggregate/n_rows", "aggregate/n_rollouts")
    plain = [{k: v for k, v in m.items() if not k.startswith(TIME_KEYS) and k != "collect/groups"}
             for m in got]
    wa, wb = final_weights(run), final_weights(ref)
    return {
        "steps_equal_to_reference": sum(all(a.get(k) == b.get(k) for k in same)
                                        for a, b in zip(got, want, strict=False)),
        "loss_max_abs_diff": max((abs(a.get("loss", 0) - b.get("loss", 0))
                                  for a, b in zip(got, want, strict=False)), default=0.0),
        "metrics_bitwise_equal": len(got) == len(want) and all(
            a == {k: v for k, v in b.items() if not k.startswith(TIME_KEYS) and k != "collect/groups"}
            for a, b in zip(plain, want, strict=True)),
        "weights_max_abs_diff": max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa),
    }


def check(run: Path, ref: Path, args: argparse.Namespace) -> dict:
    """The checks of the module docstring -> figures (0 lost, 0 repeated is the goal)."""
    from tracetrain.run import durable

    got, want = metrics(run), metrics(ref)
    steps = [m["step"] for m in got]
    out: dict = {"steps_logged": len(steps),
                 "steps_lost": len(set(range(args.steps)) - set(steps)),
                 "steps_repeated": len(steps) - len(set(steps))}
    if args.mode == "continuous":
        groups = [g.split("-", 1)[1] for m in got for g in m.get("collect/groups", [])]
        every = {f"s{n // 3}-t{n % 3}" for n in range(args.steps * 3)}
        out["groups_lost"] = len(every - set(groups))
        out["groups_repeated"] = len(groups) - len(set(groups))
    path, skipped = durable.newest_valid(run)
    out["checkpoint_verifies"] = path is not None and not skipped
    db = sqlite3.connect(run / "traces.db")
    out["traces_integrity"] = db.execute("PRAGMA integrity_check").fetchone()[0]
    out["rollouts_left_running"] = db.execute(
        "SELECT COUNT(*) FROM rollouts WHERE state IN ('queued', 'running')").fetchone()[0]
    db.close()
    out.update(compare(got, want, run, ref))
    out["staleness_max"] = max((int(k.rsplit("_", 1)[1]) for m in got for k, v in m.items()
                                if k.startswith("staleness/rollouts_") and v), default=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["step", "continuous"], default="step")
    ap.add_argument("--signal", choices=["kill", "term"], default="kill")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=1, help="trainer.checkpoint_every")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--warm-steps", type=int, default=60,
                    help="the warm start of the policy every run starts from (made once per OUT)")
    ap.add_argument("--chaos-seed", type=int, default=0, help="the kill delays' seed")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    args = ap.parse_args()
    out = args.out / f"{args.mode}-{args.signal}"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    ref, run, log = out / "reference", out / "chaos", out / "log.txt"
    policy = warm_policy(args.out / f"warm-{args.warm_steps}", log, args.warm_steps)
    ref_s = finish(config(ref, policy, args), log, 900)
    loop_s = metrics(ref)[-1]["time/elapsed_s"]  # the steps; the rest is start-up and the end
    start_s, step_s = ref_s - loop_s, loop_s / args.steps
    rng = random.Random(args.chaos_seed)
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    # a kill from start-up to a few steps in: every process makes some progress or none
    kills = [kill_once(config(run, policy, args), log, rng.uniform(0.3, start_s + 4 * step_s), sig, 20.0)
             for _ in range(args.kills)]
    finish(config(run, policy, args), log, 900)
    result = {"mode": args.mode, "signal": args.signal, "kills": len(kills), "reference_s": ref_s,
              "killed": sum(not k.get("finished_first") for k in kills),
              "hung": sum(bool(k.get("hung")) for k in kills),
              "exit_codes": sorted({k["rc"] for k in kills}),
              **check(run, ref, args)}
    if args.mode == "continuous":  # not deterministic: how far two uninterrupted runs are apart
        again = out / "reference-again"
        finish(config(again, policy, args), log, 900)
        result["reference_vs_reference"] = compare(metrics(again), metrics(ref), again, ref)
    if sig == signal.SIGTERM:
        result["sigterm_to_exit_max_s"] = max((k["exit_s"] for k in kills if "exit_s" in k), default=None)
    result["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                          if line.startswith("model name")), "?")
    result["torch_threads"] = torch.get_num_threads()
    (args.out / f"chaos-{args.mode}-{args.signal}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
