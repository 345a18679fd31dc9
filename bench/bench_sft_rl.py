"""SFT on the untrained model's successes, then RL, against RL alone: the calculator without its
worked example (SmolLM2-135M-Instruct), the same minutes, judged on held-out questions.

    .venv/bin/python bench/bench_sft_rl.py --steps 40 --out runs/sft-rl

Everything goes through the commands a user runs (`tracetrain train / sft / eval`):
1. OUT/questions.jsonl: 2,000 calculator questions (operands 2-50, + - *) with `example: false`
   (the agent sends the system prompt and the question only); data.eval_fraction 0.05 holds
   out 100 of them, never trained on.
2. RL alone: examples/calculator/config.yaml on that file for --steps steps (OUT/rl).
3. SFT then RL: `tracetrain sft --from OUT/rl --max-version 0 --min-reward 1` (the successes of
   the rollouts the untrained policy made: steps 0-1 of run 2, which both arms share), then RL
   from its policy for as many steps as fit in the minutes RL alone took, counting the SFT's
   minutes and those two steps' (OUT/sft, OUT/sft-rl; --sft-rl-steps: the count, when the
   SFT'd policy's steps are slower than RL alone's).
4. `tracetrain eval --k 4 --tasks 64` on the held-out questions for the untrained model, both
   results, and the SFT policy alone: mean reward, pass@1, pass@4.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "tracetrain"]
CONFIG = ROOT / "examples" / "calculator" / "config.yaml"


def run(args: list[str], log: Path) -> float:
    """Run a tracetrain command, its output to `log`; its wall seconds."""
    t = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run([*CLI, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="RL alone's steps")
    ap.add_argument("--out", type=Path, default=Path("runs/sft-rl"))
    ap.add_argument("--sft-rl-steps", type=int, default=None,
                    help="RL steps after the SFT (default: what fits in RL alone's minutes at RL "
                         "alone's rate; the SFT'd policy's rollouts take more turns, so its steps "
                         "are slower: give the count that fits, from a first try's s/step)")
    ap.add_argument("--sft-epochs", type=int, default=4)
    ap.add_argument("--sft-lr", type=float, default=2e-5)
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng, ops = random.Random(1), {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    with (out / "questions.jsonl").open("w") as f:
        for _ in range(2000):
            a, b, op = rng.randint(2, 50), rng.randint(2, 50), rng.choice(sorted(ops))
            f.write(json.dumps({"question": f"What is {a} {op} {b}?", "answer": ops[op](a, b),
                                "max_turns": 3, "example": False}) + "\n")
    data = [f"data.train={out / 'questions.jsonl'}", "data.eval_fraction=0.05",
            "data.fields=[question,answer,max_turns]", "trainer.eval_every=0"]
    times = {}
    times["rl"] = run(["train", str(CONFIG), *data, f"trainer.steps={args.steps}",
                       f"trainer.run_dir={out / 'rl'}"], out / "rl.log")
    metrics = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    per_step = times["rl"] / args.steps
    shared = sum(m["time/collect_s"] for m in metrics[:2])  # the untrained policy's rollouts
    times["sft"] = run(["sft", str(CONFIG), *data, "--from", str(out / "rl"), "--max-version", "0",
                        "--min-reward", "1", "--epochs", str(args.sft_epochs), "--lr", str(args.sft_lr),
                        "--out", str(out / "sft")], out / "sft.log")
    rl_steps = args.sft_rl_steps or max(1, round((times["rl"] - times["sft"] - shared) / per_step))
    times["sft-rl"] = run(["train", str(CONFIG), *data, f"trainer.steps={rl_steps}",
                           "model.kind=pretrained", f"model.path={out / 'sft' / 'policy'}",
                           f"trainer.run_dir={out / 'sft-rl'}"], out / "sft-rl.log")
    results = {}
    for name, policy in (("untrained", None), ("RL alone", out / "rl" / "policy"),
                         ("SFT alone", out / "sft" / "policy"), ("SFT then RL", out / "sft-rl" / "policy")):
        extra = [] if policy is None else ["--policy", str(policy)]
        run(["eval", str(CONFIG), *data, *extra, "--k", "4", "--tasks", "64",
             "--out", str(out / f"eval-{name.replace(' ', '-')}.jsonl")],
            out / f"eval-{name.replace(' ', '-')}.log")
        results[name] = json.loads((out / f"eval-{name.replace(' ', '-')}.log").read_text()
                                   .strip().splitlines()[-1])
    sft = json.loads((out / "sft" / "sft.json").read_text())
    rl_metrics = [json.loads(x) for x in (out / "sft-rl" / "metrics.jsonl").read_text().splitlines()]
    report = {"rl_alone_steps": args.steps, "rl_alone_min": times["rl"] / 60,
              "sft_min": times["sft"] / 60, "shared_collect_min": shared / 60,
              "sft_then_rl_steps": rl_steps, "sft_then_rl_rl_min": times["sft-rl"] / 60,
              "sft_rollouts": sft["trained_rollouts"], "sft_losses": sft["epoch_losses"],
              "rl_alone_train_reward_first_last10": [sum(m["reward_mean"] for m in metrics[:10]) / 10,
                                                     sum(m["reward_mean"] for m in metrics[-10:]) / 10],
              "sft_then_rl_train_reward_first_last": [rl_metrics[0]["reward_mean"],
                                                      rl_metrics[-1]["reward_mean"]],
              "eval": results}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
