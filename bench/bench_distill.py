"""On-policy distillation against RL from the reward alone (issue 60), SmolLM2-135M-Instruct on this
machine's CPU cores, on one of two tasks (--task):

- calculator (part 2): examples/calculator without its worked example (examples/distill/
  calculator.yaml), on OUT/questions.jsonl (5,120 questions, `example: false`; data.eval_fraction
  0.1 holds out 512). The teacher: examples/calculator/config.yaml for 20 steps (with the example),
  then examples/distill/calculator_teacher.yaml from its policy (30 steps without it).
- chain_sum (part 1): reasoning-gym chain_sum, two terms of 1-2 digits (examples/distill/
  teacher.yaml: the task of examples/reasoning_gym with 512 rows held out). The teacher: RL from
  the reward alone in segments of --segment steps up to --teacher-steps, resumed each time, each
  segment's policy scored and the best kept.

    .venv/bin/python bench/bench_distill.py teacher --task calculator --out runs/bench_distill_calc
    .venv/bin/python bench/bench_distill.py arms --task calculator --out runs/bench_distill_calc --seeds 0 1 2
    .venv/bin/python bench/bench_distill.py report --out runs/bench_distill_calc

teacher: the teacher's policy is scored greedily on the 512 held-out rows (`tracetrain eval
--temperature 0 --k 1`) and kept as OUT/teacher/best (its score and step in OUT/teacher/best.json).

arms: for each seed, three runs from the untrained model (--steps steps; the distilled arms
--steps-distilled), the same tasks, the same settings, held-out greedy pass@1 on 256 rows every 5
steps (the runs' own eval passes):
- rl: the reward alone (the distill config less its `distill` section);
- distill: the teacher's term alone (distill.with_reward false);
- both: the reward-based advantage plus the teacher's term (distill.with_reward true).
Each run is OUT/arms/<arm>-s<seed> (<arm>-c<coef>-s<seed> with --coef); a finished one is skipped
when the command runs again.

report: the target is the teacher's score p minus 2 standard errors, the standard error that of
Agresti-Coull's p~ = (x + 2) / (n + 4) over the n = 512 rows: sqrt(p~ (1 - p~) / (n + 4)) (the plain
sqrt(p (1 - p) / n) is 0 for a teacher right on every row, which would ask a perfect score); for
each run, the first step whose eval reaches it (and 0.9, 0.95); the median over seeds per arm; the
ratio distill / rl (goal <= 1/3); each arm's curve; the teacher's scoring time per step against
collection and the update (time/teacher_s, time/collect_s, time/update_s means).
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TEACHER_CFG = EXAMPLES / "distill" / "teacher.yaml"
DISTILL_CFG = EXAMPLES / "distill" / "config.yaml"
TT = [sys.executable, "-m", "tracetrain"]
HELD_OUT = 512  # 5,120 rows, data.eval_fraction 0.1
EVAL_TASKS = 256
THRESHOLDS = (0.9, 0.95)  # besides the target


def task_setup(task: str, out: Path) -> tuple[Path, list[str]]:
    """(the arms' config, the overrides every command of `task` takes): for the calculator,
    OUT/questions.jsonl written (the same 5,120 rows each time) and the data keys that read it."""
    if task == "chain_sum":
        return DISTILL_CFG, []
    rng, ops = random.Random(1), {"+": operator.add, "-": operator.sub, "*": operator.mul}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "questions.jsonl", "w") as f:
        for _ in range(5120):
            a, b, op = rng.randint(2, 50), rng.randint(2, 50), rng.choice(sorted(ops))
            f.write(json.dumps({"question": f"What is {a} {op} {b}?", "answer": ops[op](a, b),
                                "max_turns": 3, "example": False}) + "\n")
    return EXAMPLES / "distill" / "calculator.yaml", [
        f"data.train={out / 'questions.jsonl'}", "data.eval_fraction=0.1",
        "data.fields=[question,answer,max_turns]"]


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()), "commit": commit,
            "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)


def greedy_score(config: Path, policy: Path, log: Path, data: list[str] = ()) -> float:
    """pass@1 of `policy`, greedy, on the HELD_OUT held-out rows (the summary line `tracetrain
    eval` prints last)."""
    run([*TT, "eval", str(config), *data, "--policy", str(policy), "--temperature", "0", "--k", "1",
         "--tasks", str(HELD_OUT)], log)
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and '"pass@1"' in line:
            return float(json.loads(line)["pass@1"])
    raise RuntimeError(f"no pass@1 in {log}")


def calculator_teacher(args) -> None:
    """The calculator's teacher: examples/calculator (its worked example shown) for 20 steps, then
    calculator_teacher.yaml from that policy, without the example, on the questions file."""
    config, data = task_setup("calculator", args.out)
    out = args.out / "teacher"
    out.mkdir(parents=True, exist_ok=True)
    first, run_dir, log = out / "with_example", out / "run", out / "log.txt"
    t = time.time()
    if not (first / "policy").is_dir():
        shutil.rmtree(first, ignore_errors=True)
        run([*TT, "train", str(EXAMPLES / "calculator" / "config.yaml"), "trainer.steps=20",
             "trainer.eval_every=0", f"trainer.run_dir={first}"], log)
    shutil.rmtree(run_dir, ignore_errors=True)  # (a run of its own each time)
    run([*TT, "train", str(EXAMPLES / "distill" / "calculator_teacher.yaml"), *data,
         f"model.path={first / 'policy'}", f"trainer.steps={args.teacher_steps}",
         f"trainer.run_dir={run_dir}"], log)
    train_s = time.time() - t
    score = greedy_score(config, run_dir / "policy", log, data)
    best = {"step": args.teacher_steps, "pass@1": score, "train_s": train_s, **machine()}
    shutil.rmtree(out / "best", ignore_errors=True)
    shutil.copytree(run_dir / "policy", out / "best")
    (out / "best.json").write_text(json.dumps(best))
    print("best", json.dumps(best))


def teacher(args) -> None:
    if args.task == "calculator":
        return calculator_teacher(args)
    out = args.out / "teacher"
    out.mkdir(parents=True, exist_ok=True)
    run_dir, log = out / "run", out / "log.txt"
    best = json.loads((out / "best.json").read_text()) if (out / "best.json").exists() else None
    done = [json.loads(x) for x in (out / "segments.jsonl").read_text().splitlines()] \
        if (out / "segments.jsonl").exists() else []
    steps = done[-1]["step"] if done else 0
    while steps < args.teacher_steps:
        steps = min(args.teacher_steps, steps + args.segment)
        t = time.time()
        run([*TT, "train", str(TEACHER_CFG), f"trainer.steps={steps}", f"trainer.run_dir={run_dir}",
             "trainer.resume=true", "trainer.eval_every=0", f"trainer.seed={args.teacher_seed}"], log)
        train_s = time.time() - t
        score = greedy_score(TEACHER_CFG, run_dir / "policy", log)
        seg = {"step": steps, "pass@1": score, "train_s": train_s, **machine()}
        with open(out / "segments.jsonl", "a") as f:
            f.write(json.dumps(seg) + "\n")
        print(json.dumps(seg), flush=True)
        if best is None or score > best["pass@1"]:
            shutil.rmtree(out / "best", ignore_errors=True)
            shutil.copytree(run_dir / "policy", out / "best")
            best = seg
            (out / "best.json").write_text(json.dumps(best))
    print("best", json.dumps(best))


ARMS = {"rl": ["distill=null"],
        "distill": ["distill.with_reward=false"],
        "both": ["distill.with_reward=true"]}


def arms(args) -> None:
    best = args.out / "teacher" / "best"
    if not best.is_dir():
        raise SystemExit(f"no teacher at {best}: run `bench_distill.py teacher` first")
    config, data = task_setup(args.task, args.out)
    for seed in args.seeds:
        for arm in args.arms:
            extra = [*data, *ARMS[arm]]
            scaled = args.coef != 1.0 and arm != "rl"
            run_dir = args.out / "arms" / (f"{arm}-c{args.coef:g}-s{seed}" if scaled else f"{arm}-s{seed}")
            if (run_dir / "summary.json").exists():
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            (run_dir / "machine.json").write_text(json.dumps(machine()))
            steps = args.steps if arm == "rl" else args.steps_distilled or args.steps
            over = [f"trainer.steps={steps}", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    "trainer.eval_every=5", f"trainer.eval_tasks={EVAL_TASKS}", *extra]
            if arm != "rl":
                over += [f"distill.teacher.path={best}", f"distill.coef={args.coef}"]
            t = time.time()
            run([*TT, "train", str(config), *over], run_dir / "log.txt")
            print(f"{arm} seed {seed}: {time.time() - t:.0f} s", flush=True)


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """[(steps trained, held-out pass@1)]: the initial pass and each eval pass."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = []
    for m in rows:
        if "eval/initial_reward_mean" in m:
            out.append((0, m["eval/initial_reward_mean"]))
        if "eval/reward_mean" in m:
            out.append((m["step"] + 1, m["eval/reward_mean"]))
    return out


def report(args) -> None:
    best = json.loads((args.out / "teacher" / "best.json").read_text())
    p = best["pass@1"]
    q = (p * HELD_OUT + 2) / (HELD_OUT + 4)  # Agresti-Coull
    target = p - 2 * math.sqrt(q * (1 - q) / (HELD_OUT + 4))
    print(f"teacher: pass@1 {p:.3f} on {HELD_OUT} held-out rows after {best['step']} RL steps "
          f"({best['cpu']}, commit {best['commit']}); target {target:.3f}")
    reached: dict[str, list[float]] = {}  # by arm (and coef): rl, distill, distill-c8, ...
    for arm in ARMS:
        for run_dir in sorted((args.out / "arms").glob(f"{arm}-*s*")):
            if not (run_dir / "metrics.jsonl").exists():
                continue
            c = curve(run_dir)
            hit = next((s for s, v in c if v >= target), math.inf)
            reached.setdefault(run_dir.name.rsplit("-s", 1)[0], []).append(hit)
            at = {x: next((s for s, v in c if v >= x), math.inf) for x in THRESHOLDS}
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = {k: statistics.fmean(m.get(k, 0.0) for m in rows)
                     for k in ("time/teacher_s", "time/collect_s", "time/update_s", "time/train_s")}
            mach = json.loads((run_dir / "machine.json").read_text())
            print(f"{run_dir.name}: reached at step {hit} ("
                  + ", ".join(f"{x}: {n}" for x, n in at.items()) + "); curve "
                  + " ".join(f"{s}:{v:.3f}" for s, v in c)
                  + " | s/step " + " ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in times.items())
                  + f" | {mach['cpu']} commit {mach['commit']}")
    med = {arm: statistics.median(v) for arm, v in reached.items()}
    print("median steps to the target: " + ", ".join(f"{a} {m}" for a, m in med.items()))
    if "rl" in med and "distill" in med and math.isfinite(med["rl"]):
        print(f"distill / rl = {med['distill'] / med['rl']:.2f} (goal <= 0.33)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["teacher", "arms", "report"])
    ap.add_argument("--task", choices=["calculator", "chain_sum"], default="calculator")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_distill")
    ap.add_argument("--teacher-steps", type=int, default=None,
                    help="the teacher's RL steps (default: calculator 30, chain_sum 60)")
    ap.add_argument("--segment", type=int, default=20)
    ap.add_argument("--teacher-seed", type=int, default=100)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--steps-distilled", type=int, default=None,
                    help="the distill and both arms' steps (default: --steps); past the step that "
                         "reaches the target they only show whether it holds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--coef", type=float, default=1.0,
                    help="distill.coef of the distill and both arms (runs named <arm>-c<coef>-s<seed>)")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.teacher_steps = args.teacher_steps or {"calculator": 30, "chain_sum": 60}[args.task]
    {"teacher": teacher, "arms": arms, "report": report}[args.part](args)


if __name__ == "__main__":
    main()
