"""Held-out success against wall time on a tool environment: tracetrain vs TRL's
`GRPOTrainer(environment_factory=...)`, SmolLM2-135M-Instruct, both from the same warm-started
checkpoint, on this machine's CPU cores (issue 59).

    .venv/bin/python bench/bench_tools_trl.py --budget-s 600              # warm start, then the sides
    .venv/bin/python bench/bench_tools_trl.py --sides tracetrain-best trl-best --budget-s 300
    .venv/bin/python bench/bench_tools_trl.py --report runs/bench_tools_trl/DIR

The task is examples/environment_class/config.yaml's (--config): its environment class
(ArithmeticEnv: tools `calculate` and `submit`) and reward function (`correct`), its rows and
held-out split, its system prompt, the step's shape (rollout: tasks_per_step x n_per_task,
temperature; env.max_turns model turns).

1. warm: the config's warm start alone (its expert plays training rows through tracetrain's gateway,
   then warm_start.steps supervised steps), written as a Hugging Face directory. Both sides start from
   it: the comparison is RL against RL. (`tracetrain eval` of the untrained and the warm-started
   policy on the held-out rows are the points before training.)
2. tracetrain-best: `tracetrain train` on the config from that directory (warm start off), its own
   settings; its eval passes are timed and taken out of its clock (bench_env_trl.run_tracetrain).
   tracetrain-defaults: the config's task alone (env, data, model, rollout, advantage, the seed, the
   eval rows) with every other key at tracetrain's default, lr --defaults-lr.
3. trl-best / trl-defaults: GRPOTrainer with `environment_factory=ArithmeticEnv`,
   `reward_funcs=[correct]` on the same rows in the same order (tracetrain's
   `TaskData.train_tasks(step, k)` as an unshuffled dataset), num_generations = n_per_task, one
   generation batch of k x n rows per step, max_tool_calling_iterations = max_turns - 1,
   max_completion_length = aggregate.max_response_length (TRL's budget is the whole multi-turn
   completion), lr and temperature as tracetrain's, torch threads = engine.threads. -best: fp32,
   gradient checkpointing off (or --trl-bf16); -defaults: GRPOConfig's defaults on a CPU.
   SmolLM2's template has no tools section and TRL refuses such a template, so TRL gets SmolLM2's
   template patched to render exactly tracetrain's tool block (models/tool_prompt.py: the tools in
   the system message, calls as <tool_call> JSON, results as <tool_response> in a user turn) and the
   hermes response schema (trl's qwen3_schema) on its tokenizer. The side checks that its first-turn
   prompt ids equal the ids tracetrain's gateway recorded for the same rows.
   At each eval point the side saves the weights (the time taken out of its clock); after the run,
   `tracetrain eval` scores each saved point: the same evaluator, rows and reward as tracetrain's
   own passes (one greedy rollout per held-out row through the gateway).

Held-out success: the share of the held-out rows (trainer.eval_tasks of them) whose greedy rollout
scored 1. Wall time: from the start of training (tracetrain: `Trainer.run`; TRL: on_train_begin),
evals and saves excluded. Printed: each curve, each side's step time split into generation and the
rest, and "tracetrain's time to reach TRL's final held-out success / TRL's time" (goal <= 1/3).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env_trl import first_reach, machine, median, trl_clock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "environment_class" / "config.yaml"
PEERS = ROOT / "bench" / ".venv-peers" / "bin" / "python"
SIDES = ("tracetrain-best", "trl-best", "tracetrain-defaults", "trl-defaults")
NOT_WEIGHTS = ("config.json", "generation_config.json")


def warm_overrides(out: Path) -> list[str]:
    """The config from the warm-started directory, its own warm start off."""
    return ["model.kind=pretrained", f"model.path={out / 'warm' / 'policy'}", "model.gguf_file=null",
            "warm_start.steps=0", "warm_start.expert=null"]


# ------------------------------------------------------------------ 1. the warm start
def run_warm(args: argparse.Namespace, out: Path) -> None:
    """The config's warm start in a real `train` (precision, expert play, supervised steps), stopped
    where RL would begin: the learner's weights written as out/warm/policy."""
    from tracetrain.config import load_config
    from tracetrain.run import learner as L
    from tracetrain.run import trainer as T

    class WarmDone(Exception):
        pass

    def write_and_stop(self) -> None:  # Learner.wrap: the first thing after the warm start
        self.write_policy(out / "warm" / "policy")
        raise WarmDone

    cfg = load_config(Path(args.config), [*args.set, f"trainer.run_dir={out / 'warm' / 'run'}",
                                          "trainer.eval_every=0"])
    L.Learner.wrap = write_and_stop
    t = time.perf_counter()
    try:
        T.train(cfg, base_dir=Path(args.config).resolve().parent, log=lambda *a: print(*a, flush=True))
    except WarmDone:
        pass
    ws = json.loads((out / "warm" / "run" / "warm_start.json").read_text())
    (out / "warm.json").write_text(json.dumps({"machine": machine(), "seconds": time.perf_counter() - t,
                                               "warm_start": ws}, indent=1))


def tracetrain_eval(args: argparse.Namespace, policy: Path | None, extra: list[str]) -> dict:
    """`tracetrain eval` (one greedy rollout per held-out row) of `policy`: its summary."""
    argv = [str(ROOT / ".venv" / "bin" / "tracetrain"), "eval", args.config, "--k", "1",
            "--temperature", "0", *(["--policy", str(policy)] if policy else []), *args.set, *extra]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, env=child_env())
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ 2. tracetrain
def first_turns(trainer, db: Path) -> dict:
    """The prompt ids tracetrain's gateway recorded for the first turn of each row's rollouts,
    by question (out/first_turns.json; the TRL sides compare theirs)."""
    import sqlite3

    import numpy as np

    con = sqlite3.connect(db)
    rows = con.execute("SELECT r.task, t.prompt_ids FROM turns t JOIN rollouts r USING (rollout_id) "
                       "WHERE t.idx = 0 LIMIT 2000").fetchall()
    con.close()
    ids = {json.loads(task)["question"]: np.frombuffer(blob, dtype="<i4").tolist() for task, blob in rows}
    (Path(db).parents[1] / "first_turns.json").write_text(json.dumps(ids))
    return {"rows": len(ids)}


def run_tracetrain(args: argparse.Namespace, out: Path) -> None:
    import bench_env_trl

    args.set = [*args.set, *warm_overrides(out)]
    bench_env_trl.run_tracetrain(args, out, check=first_turns)


# ------------------------------------------------------------------ 3. TRL
def tool_template(chat_template: str) -> str:
    """SmolLM2's ChatML template rendering tracetrain's tool block (models/tool_prompt.py,
    with_tool_block) from `tools`, assistant `tool_calls` and `tool` messages."""
    from tracetrain.models.tool_prompt import TOOL_BLOCK

    head, tail = (json.dumps(part.replace("{{", "{").replace("}}", "}"))
                  for part in TOOL_BLOCK.split("{tools}"))
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert default_system in chat_template, "not SmolLM2's template"
    return (
        "{%- set ns = namespace(block='') -%}"
        "{%- if tools -%}{%- set ns.block = " + head + " -%}"
        "{%- for t in tools -%}{%- set ns.block = ns.block + (t | tojson) + ('' if loop.last else '\\n') -%}"
        "{%- endfor -%}{%- set ns.block = ns.block + " + tail + " -%}{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\n' + (ns.block if tools else '" + default_system + "') + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- if message['role'] == 'system' -%}"
        "{%- set content = message['content'] or '' -%}"
        "{%- if tools -%}{%- set content = (content + '\\n\\n' + ns.block) if content else ns.block -%}"
        "{%- endif -%}"
        "{{ '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{ '<|im_start|>user\\n' }}"
        "{%- else -%}{{ '\\n' }}{%- endif -%}"
        "{{ '<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
        "{%- set ns.parts = [message['content']] if message['content'] else [] -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- set f = call['function'] if call.get('function') else call -%}"
        "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
        "{%- set ns.parts = ns.parts + ['<tool_call>\\n{\"name\": ' + (f['name'] | tojson) + "
        "', \"arguments\": ' + args + '}\\n</tool_call>'] -%}"
        "{%- endfor -%}"
        "{{ '<|im_start|>assistant\\n' + (ns.parts | join('\\n')) + '<|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def run_trl(args: argparse.Namespace, out: Path) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_schema

    from tracetrain.agents.tasks import open_task_data
    from tracetrain.config import load_config
    from tracetrain.envs import load_source
    from tracetrain.envs.environment_class import prompt_messages

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    path = Path(args.config)
    cfg = load_config(path, args.set)
    base = path.resolve().parent
    env = load_source(cfg, base)
    data = open_task_data(cfg, base, env)
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    warm = out / "warm" / "policy"
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(warm)
    tok.chat_template = tool_template(tok.chat_template)
    tok.response_schema = qwen3_schema  # hermes: <tool_call>{"name", "arguments"}</tool_call>
    k, g = cfg.rollout.tasks_per_step, cfg.rollout.n_per_task
    entries: list[dict] = []
    for s in range(args.trl_max_steps):
        entries.extend(data.train_tasks(s, k))
    rows = [{**e, "prompt": prompt_messages(e, cfg.env.system_prompt, None)} for e in entries]
    dataset = Dataset.from_list(rows)
    best = args.side == "trl-best"
    micro = 8  # TrainingArguments' per_device_train_batch_size default
    settings = {"bf16": args.trl_bf16, "gradient_checkpointing": False} if best else {}
    gcfg = GRPOConfig(
        output_dir=str(out / f"{args.side}-out"), use_cpu=True, per_device_train_batch_size=micro,
        gradient_accumulation_steps=k * g // micro, num_generations=g,
        max_completion_length=cfg.aggregate.max_response_length,
        max_tool_calling_iterations=cfg.env.max_turns - 1, temperature=cfg.rollout.temperature,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", shuffle_dataset=False,
        max_steps=args.trl_max_steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=cfg.trainer.seed, **settings)
    rec = {"side": args.side, "machine": machine(), "points": [], "steps": [], "eval_s": 0.0,
           "trl": trl.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads(),
           "settings": {"bf16": gcfg.bf16, "gradient_checkpointing": gcfg.gradient_checkpointing,
                        "lr": gcfg.learning_rate, "loss_type": gcfg.loss_type, "beta": gcfg.beta,
                        "per_device_train_batch_size": micro,
                        "gradient_accumulation_steps": gcfg.gradient_accumulation_steps,
                        "max_completion_length": gcfg.max_completion_length,
                        "max_tool_calling_iterations": gcfg.max_tool_calling_iterations}}
    budget, every = args.budget_s, args.eval_every_s
    saved: list[tuple[int, float, Path]] = []

    def save(step: int, clock: float) -> None:
        t = time.perf_counter()
        dst = out / f"{args.side}-points" / f"step-{step}"
        model.save_pretrained(dst)
        for f in warm.iterdir():  # the tokenizer as tracetrain wrote it (the template unpatched)
            if f.is_file() and f.suffix != ".safetensors" and f.name not in NOT_WEIGHTS:
                shutil.copy(f, dst / f.name)
        saved.append((step, clock, dst))
        rec["eval_s"] += time.perf_counter() - t

    def calls(metrics: dict) -> dict:
        return {"tool_call_frequency": float((metrics.get("tools/call_frequency") or [float("nan")])[-1])}

    clock = trl_clock(rec, budget, every, save, extra=calls)
    t = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=env.reward_funcs, args=gcfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[clock], environment_factory=env.factory)
    rec["construct_s"] = time.perf_counter() - t
    rec["chat_template_replaced_by_trl"] = trainer.chat_template is not None
    theirs = {e["question"]: tok.apply_chat_template(
        r["prompt"], tools=trainer._env_tools[None] or None, chat_template=trainer.chat_template,
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for e, r in zip(entries[:400], rows[:400], strict=True)}
    (out / f"first_turns-{args.side}.json").write_text(json.dumps(theirs))  # (the report compares)
    clock.attach(trainer)
    trainer.train()
    rec["saved"] = [{"step": s, "clock_s": c, "dir": str(d)} for s, c, d in saved]
    rec["machine_end"] = machine()
    (out / f"{args.side}.json").write_text(json.dumps(rec, indent=1))


def score_trl(args: argparse.Namespace, out: Path, side: str) -> None:
    """`tracetrain eval` of each point a TRL side saved: its curve (the warm start's at 0 s)."""
    rec = json.loads((out / f"{side}.json").read_text())
    warm = json.loads((out / "warm.json").read_text())
    rec["points"] = [{"step": 0, "clock_s": 0.0, **warm["eval"]}]
    for p in rec["saved"]:
        t = time.perf_counter()
        summary = tracetrain_eval(args, Path(p["dir"]), [])
        point = {"step": p["step"], "clock_s": p["clock_s"], "pass1": summary["pass@1"],
                 "reward_mean": summary.get("reward_mean"), "eval_s": time.perf_counter() - t}
        rec["points"].append(point)
        print(f"  {side} after step {p['step']}: success {point['pass1']:.3f} at {p['clock_s']:.0f} s",
              flush=True)
    (out / f"{side}.json").write_text(json.dumps(rec, indent=1))


# ------------------------------------------------------------------ the report
def report(out: Path) -> None:
    print(f"\n{out}")
    warm = json.loads((out / "warm.json").read_text()) if (out / "warm.json").is_file() else None
    if warm:
        ws = warm["warm_start"]
        print(f"warm start: {warm['seconds']:.0f} s ({ws.get('warm_start/expert_rollouts')} expert rollouts, "
              f"reward {ws.get('warm_start/expert_reward_mean', float('nan')):.3f}; "
              f"{ws.get('warm_start/steps')} supervised steps); held-out success untrained "
              f"{warm['untrained']['pass1']:.3f}, warm-started {warm['eval']['pass1']:.3f} (tracetrain eval)")
    recs = {s: json.loads((out / f"{s}.json").read_text()) for s in SIDES if (out / f"{s}.json").is_file()}
    for side, rec in recs.items():
        steps, m = rec["steps"], rec["machine"]
        if side.startswith("tracetrain"):
            what = (f"collect {median([s['collect_s'] for s in steps]):.1f} s, learn (rows + update + "
                    f"sync) {median([s['learn_s'] for s in steps]):.1f} s")
        else:
            st = rec["settings"]
            what = (f"generation {median([s['gen_s'] for s in steps]):.1f} s, rest of the step "
                    f"{median([s['step_s'] - s['gen_s'] for s in steps]):.1f} s; bf16 {st['bf16']}, "
                    f"gradient checkpointing {st['gradient_checkpointing']}, loss {st['loss_type']}")
        per_step = steps[-1]["clock_s"] / len(steps) if steps else float("nan")
        print(f"\n{side}: {len(steps)} steps, {per_step:.1f} s per step; medians: {what}")
        if side.startswith("trl") and (out / "first_turns.json").is_file():
            ours = json.loads((out / "first_turns.json").read_text())
            theirs = json.loads((out / f"first_turns-{side}.json").read_text())
            both = [q for q in theirs if q in ours]
            print(f"  first-turn prompt ids: {sum(ours[q] == theirs[q] for q in both)} of {len(both)} "
                  "rows equal to those tracetrain's gateway recorded")
        print(f"  {m['cpu']}, {m['cores']} cores; {m['utc']} UTC, load average at start "
              f"{m['loadavg'][0]:.2f}")
        print("  " + "  ".join(f"{p['clock_s']:.0f}s:{p['pass1']:.3f}" for p in rec["points"]))
    for ours, peer in (("tracetrain-best", "trl-best"), ("tracetrain-defaults", "trl-defaults"),
                       ("tracetrain-best", "trl-defaults"), ("tracetrain-defaults", "trl-best")):
        if ours not in recs or peer not in recs or not recs[peer]["points"]:
            continue
        tp, pp = recs[ours]["points"], recs[peer]["points"]
        target, t_end = pp[-1]["pass1"], pp[-1]["clock_s"]
        reach = first_reach(tp, target)
        line = f"\n{ours} vs {peer}: {peer}'s final success {target:.3f} at {t_end:.0f} s"
        if reach is None:
            line += f"; tracetrain never reached it (its best {max(p['pass1'] for p in tp):.3f})"
        else:
            line += f"; tracetrain reached it at {reach:.0f} s: ratio {reach / max(t_end, 1e-9):.2f}"
        print(line)
    print("goal: tracetrain's time to reach TRL's final held-out success / TRL's time <= 1/3")


# ------------------------------------------------------------------ the driver
def child_env() -> dict:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "TRL_EXPERIMENTAL_SILENCE": "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--sides", nargs="*", default=list(SIDES[:2]), choices=SIDES)
    ap.add_argument("--budget-s", type=float, default=600.0, help="training seconds per side (evals out)")
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--trl-bf16", action="store_true", help="trl-best keeps bf16 autocast")
    ap.add_argument("--defaults-lr", type=float, default=1e-5, help="tracetrain-defaults' lr")
    ap.add_argument("--trl-max-steps", type=int, default=500,
                    help="TRL's max_steps (the budget ends it first)")
    ap.add_argument("--tt-set", nargs="*", default=[], help="overrides of tracetrain-best alone")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (key=value) for every side")
    ap.add_argument("--out", default=None, help="the results' folder (default runs/bench_tools_trl/<time>)")
    ap.add_argument("--report", default=None, help="print the report of a results folder and exit")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    out = Path(args.out or ROOT / "runs" / "bench_tools_trl" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.side:
        {"warm": run_warm, "tracetrain-best": run_tracetrain,
         "tracetrain-defaults": run_tracetrain}.get(args.side, run_trl)(args, out)
        return
    passthrough = list(sys.argv[1:])
    if "--sides" in passthrough:
        i = j = passthrough.index("--sides")
        j += 1
        while j < len(passthrough) and not passthrough[j].startswith("--"):
            j += 1
        del passthrough[i:j]
    tt_python = str(ROOT / ".venv" / "bin" / "python")

    def child(side: str, python: str) -> None:
        print(f"== {side} ({time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.2f})", flush=True)
        subprocess.run([python, __file__, *passthrough, "--out", str(out), "--side", side],
                       check=True, env=child_env())

    if not (out / "warm.json").is_file():
        child("warm", tt_python)
        rec = json.loads((out / "warm.json").read_text())
        for name, policy in (("untrained", None), ("eval", out / "warm" / "policy")):
            s = tracetrain_eval(args, policy, [])
            rec[name] = {"pass1": s["pass@1"], "reward_mean": s.get("reward_mean"),
                         "tools/calls_per_rollout": s.get("tools/calls_per_rollout")}
        (out / "warm.json").write_text(json.dumps(rec, indent=1))
    for side in args.sides:
        if side.startswith("trl"):
            child(side, str(PEERS))
            score_trl(args, out, side)
        else:
            child(side, tt_python)
    report(out)


if __name__ == "__main__":
    main()
