"""Held-out pass@1 against wall time on a reasoning-gym task: tracetrain vs TRL's GRPOTrainer,
SmolLM2-135M-Instruct on this machine's CPU cores (issue 42).

    .venv/bin/python bench/bench_env_trl.py --budget-s 900                # the four sides, in turn
    .venv/bin/python bench/bench_env_trl.py --sides tracetrain-best trl-best --budget-s 180
    .venv/bin/python bench/bench_env_trl.py --report runs/bench_env_trl/DIR   # print it again

The task is examples/reasoning_gym/smollm2.yaml's (--config): its `env.reasoning_gym` rows, its
held-out split (`data`), its prompts (the env's messages: system prompt + the entry's question),
its reward (the dataset's own `score_answer` on the env's answer extraction), and the step's shape
(`rollout`: tasks_per_step questions x n_per_task generations, max_tokens, temperature). Both
sides take all of that from the same config objects: the same train rows in the same order (TRL
gets tracetrain's `TaskData.train_tasks(step, k)` as an unshuffled dataset, so step s trains the
same questions on both), the same held-out rows (the first trainer.eval_tasks of the split), the
same chat template applied to the same messages, the same weights (tracetrain's GGUF load,
handed to GRPOTrainer as the module itself).

The sides (each a child process of this script, one after another, never two at once):
- tracetrain-best: `tracetrain train` on the config as it is (its best settings: precision auto,
  collect overlap, the lr and update split found for it; see the config's comments).
- tracetrain-defaults: the config's task alone (env, data, model, rollout, advantage, the seed, the
  eval rows) with every other key at tracetrain's default, but `optim.lr` (--defaults-lr).
- trl-best: GRPOTrainer with gradient checkpointing off and bf16 autocast off (fp32, as
  bench_grpo_smollm2 found faster on a CPU without AVX-512 BF16) or, with --trl-bf16, on (faster
  where the CPU has AVX-512 BF16), --trl-lr.
- trl-defaults: GRPOConfig as a CPU user gets it (bf16 autocast, gradient checkpointing, 8 rows per
  micro-batch, loss dapo, ...), lr --defaults-lr.
Both TRL sides: the step's shape as above (per_device_train_batch_size 8, gradient accumulation so
that one optimizer step takes one generation batch of tasks_per_step x n_per_task rows),
shuffle_dataset off (the order above), a constant lr (tracetrain's; the budget, not max_steps,
ends the run), torch threads = engine.threads.

Held-out pass@1: one greedy completion (temperature 0, max_tokens as in training) of each held-out
row, scored by the same reward; pass = reward 1 (the dataset's score_answer gives partial credit
below 1, which the training reward keeps). tracetrain: its own eval pass (Trainer.evaluate: the
rows through its gateway and engine), timed and recorded here. TRL: a callback that generates
greedily with the model being trained (transformers `generate`, left-padded batch, the prompts as
GRPOTrainer tokenizes them: `apply_chat_template(..., add_generation_prompt=True)`).

Wall time: a side's clock starts when its training starts (tracetrain: `Trainer.run`'s start, after
the model load, so it includes the precision probe, the engine's and gateway's start; TRL: the
`on_train_begin` callback, after GRPOTrainer's construction) and every eval pass is taken out of
it (timed around the pass; tracetrain's overlapped collect of the next step, which an eval waits
for, stays in). A point of the curve is (the clock at the end of the step after which the eval
ran, its pass@1); the untrained model's pass is the point at 0 s. An eval runs after the first step
that ends past each multiple of --eval-every-s, and after the step that ends past --budget-s, which
is the side's last. Printed: each curve, the time of each step split into generation and the rest
(what limits each side), and "tracetrain's time to reach TRL's final held-out pass@1 / TRL's time"
(TRL's time: the clock of its last point; also against the first TRL point that reached it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "reasoning_gym" / "smollm2.yaml"
SIDES = ("tracetrain-best", "trl-best", "tracetrain-defaults", "trl-defaults")
NEVER = 10**9  # trainer.eval_every between the passes this script asks for
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(reply: str) -> str | None:
    """The answer extraction of examples/reasoning_gym/smollm2*.yaml (`env.reasoning_gym.answer`):
    the last number in the reply. SmolLM2-135M-Instruct never writes <answer> tags nor a bare
    number, but answers "The answer to this arithmetic problem is 7." """
    found = NUMBER.findall(reply)
    return found[-1] if found else None


def machine() -> dict:
    """The CPU, the load and the time, recorded with every side's figures."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def cpu_s() -> float:
    """CPU seconds this process used so far (all its threads: engine, gateway, update)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def task_config(path: Path, overrides: list[str]):
    from tracetrain.config import load_config

    return load_config(path, overrides)


def defaults_overrides(path: Path, lr: float) -> dict:
    """The config's task alone, every other key at tracetrain's default, lr `lr` (see module doc)."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    keep = {k: raw[k] for k in ("env", "data", "model", "rollout", "advantage") if k in raw}
    trainer = {k: raw["trainer"][k] for k in ("seed", "eval_tasks") if k in raw.get("trainer", {})}
    engine = {k: raw["engine"][k] for k in ("threads",) if k in raw.get("engine", {})}
    return {**keep, "trainer": trainer, "engine": engine, "optim": {"lr": lr}}


# ------------------------------------------------------------------ tracetrain side
def run_tracetrain(args: argparse.Namespace, out: Path, check=None) -> None:
    """One tracetrain side (module doc); `check(trainer, traces_db)`: its prompt check
    (default check_prompts), recorded as `prompt_check`."""
    from tracetrain.config import build_config
    from tracetrain.run import trainer as T
    from tracetrain.run.evaluate import eval_tasks

    base = Path(args.config).resolve().parent
    fixed = {"trainer": {"steps": 100_000, "eval_every": NEVER, "run_dir": str(out / f"{args.side}-run"),
                         "checkpoint_every": 0}}
    if args.side == "tracetrain-defaults":
        tree = defaults_overrides(Path(args.config), args.defaults_lr)
    else:
        import yaml

        tree = yaml.safe_load(Path(args.config).read_text())
    for key, value in fixed["trainer"].items():
        tree.setdefault("trainer", {})[key] = value
    extra = args.tt_set if args.side == "tracetrain-best" else []
    cfg = build_config(tree, [*args.set, *extra], base_dir=base)
    budget, every = args.budget_s, args.eval_every_s
    rec = {"side": args.side, "machine": machine(), "points": [], "steps": [], "eval_s": 0.0,
           "config": cfg.model_dump(mode="json")}
    state = {"next": every, "clock": 0.0, "evals": []}
    make_collector = T.collector_for

    def timed_collector(play, sync, stop, log=print):
        """The run's collector (run/collectors.py), its step's learn timed: from the end of
        `taken` (the rollouts in hand: rows, update and sync follow) to the end of `synced`."""
        collector = make_collector(play, sync, stop, log)
        taken, synced = collector.taken, collector.synced

        async def timed_taken(st):
            await taken(st)
            state["learn_t0"] = time.perf_counter()

        async def timed_synced(st, updated):
            times = await synced(st, updated)
            end_of_step(state["trainer"], st.step + 1)  # (the loop counts it done next)
            return times

        collector.taken, collector.synced = timed_taken, timed_synced
        return collector

    def end_of_step(self, step: int) -> None:
        """The step's learn done, before its eval: the clock; this step the last, or an eval due."""
        now = time.perf_counter()
        clock = now - self.started - rec["eval_s"]
        state.update(clock=clock, learn_s=now - state["learn_t0"],
                     cpu_s=cpu_s() - state.get("cpu0", 0.0) - rec.get("eval_cpu_s", 0.0))
        if clock >= budget:
            self.cfg.trainer.steps = step  # this step is the last; its eval follows
            self.cfg.trainer.eval_every = 1
        elif clock >= state["next"]:
            self.cfg.trainer.eval_every = 1
            while state["next"] <= clock:
                state["next"] += every

    record = T.Trainer.record

    def timed_record(self, m, bar):  # the step's line, then its eval's (as they ran)
        step, clock = m["step"] + 1, state["clock"]
        rec["steps"].append({"step": step, "clock_s": clock, "learn_s": state["learn_s"],
                             "cpu_s": state["cpu_s"], "collect_s": m.get("time/collect_s"),
                             "update_s": m.get("time/update_s"), "train_s": m.get("time/train_s"),
                             "reward_mean": m.get("reward_mean"), "precision": self.cfg.trainer.precision})
        print(f"  step {step}: clock {clock:.1f} s, reward {m.get('reward_mean', float('nan')):.3f}, "
              f"collect {m.get('time/collect_s', 0):.1f} s", flush=True)
        for line in state["evals"]:
            print(line, flush=True)
        state["evals"].clear()
        record(self, m, bar)

    async def timed_evaluate(self, play):
        t, c, step = time.perf_counter(), cpu_s(), self.state.step
        tasks = eval_tasks(self.cfg, self.task, self.data, self.cfg.trainer.eval_tasks)
        results = await play.rollouts(tasks, f"{self.nonce}-eval{step}", 1, 0.0, step)
        rewards = [r.reward for r in results if r.state == "succeeded" and r.reward is not None]
        dt = time.perf_counter() - t
        rec["eval_s"] += dt
        rec["eval_cpu_s"] = rec.get("eval_cpu_s", 0.0) + cpu_s() - c
        point = {"step": step, "clock_s": state["clock"] if step else 0.0,
                 "pass1": sum(x >= 1 for x in rewards) / len(tasks),
                 "reward_mean": sum(rewards) / len(tasks), "scored": len(rewards), "n": len(tasks),
                 "eval_s": dt}
        rec["points"].append(point)
        state["evals"].append(f"  eval after step {step}: pass@1 {point['pass1']:.3f} at "
                              f"{point['clock_s']:.1f} s (eval {dt:.1f} s)")
        if not step:  # (before the first step: no step line to follow)
            print(state["evals"].pop(), flush=True)
        self.cfg.trainer.eval_every = NEVER
        return {"reward_mean": point["reward_mean"]}

    run = T.Trainer.run

    async def counted_run(self):  # its start is the clock's (self.started)
        state["trainer"], state["cpu0"] = self, cpu_s()
        return await run(self)

    T.collector_for = timed_collector
    T.Trainer.record, T.Trainer.evaluate, T.Trainer.run = timed_record, timed_evaluate, counted_run
    T.train(cfg, base_dir=base, log=lambda *a: print(*a, flush=True))
    rec["machine_end"] = machine()
    rec["prompt_check"] = (check or check_prompts)(state["trainer"], Path(cfg.trainer.run_dir) / "traces.db")
    (out / f"{args.side}.json").write_text(json.dumps(rec, indent=1))


def check_prompts(trainer, db: Path) -> dict:
    """The prompt ids tracetrain's gateway recorded for the rollouts' first turns against those
    GRPOTrainer makes of the same messages (`apply_chat_template(..., add_generation_prompt=True)`,
    trl's _tokenize_prompts): how many of them are the same."""
    import sqlite3

    import numpy as np

    con = sqlite3.connect(db)
    rows = con.execute("SELECT r.task, t.prompt_ids FROM turns t JOIN rollouts r USING (rollout_id) "
                       "WHERE t.idx = 0 LIMIT 400").fetchall()
    con.close()
    same = 0
    for task, blob in rows:
        ours = np.frombuffer(blob, dtype="<i4").tolist()
        theirs = trainer.learner.tokenizer.apply_chat_template(
            trainer.task.messages(json.loads(task)), add_generation_prompt=True, tokenize=True,
            return_dict=True)["input_ids"]
        same += ours == list(theirs)
    return {"turns": len(rows), "same_ids": same}


# ------------------------------------------------------------------ TRL side
def run_trl(args: argparse.Namespace, out: Path) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tracetrain.agents.tasks import open_task_data
    from tracetrain.envs import load_source
    from tracetrain.models.load import load_policy
    from tracetrain.run.evaluate import eval_tasks

    path = Path(args.config)
    cfg = task_config(path, args.set)
    base = path.resolve().parent
    env = load_source(cfg, base)
    data = open_task_data(cfg, base, env)
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    model, tok = load_policy(cfg.model, seed=cfg.trainer.seed)
    model.train()
    k, g, new = cfg.rollout.tasks_per_step, cfg.rollout.n_per_task, cfg.rollout.max_tokens
    max_steps = args.trl_max_steps
    entries: list[dict] = []
    for s in range(max_steps):
        entries.extend(data.train_tasks(s, k))
    dataset = Dataset.from_list([{"prompt": env.messages(e), "i": i} for i, e in enumerate(entries)])
    held = eval_tasks(cfg, env, data, cfg.trainer.eval_tasks)
    held_ids = [tok.apply_chat_template(env.messages(e), add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"] for e in held]
    score = env.dataset.score_answer

    def reward(completions, i, **_):
        return [float(score(env.extract(c[-1]["content"]), entries[j]))
                for c, j in zip(completions, i, strict=True)]

    best = args.side == "trl-best"
    micro = args.trl_micro if best else 8  # 8: TrainingArguments' per_device_train_batch_size
    settings = {"bf16": args.trl_bf16, "gradient_checkpointing": False} if best else {}
    lr = (args.trl_lr if best else args.defaults_lr)
    # one generation batch of k x g rows; by default one optimizer step takes all of it (gradient
    # accumulation), with --trl-steps-per-generation n each takes 1/n of it
    per_gen = args.trl_steps_per_generation if best and args.trl_steps_per_generation else 1
    accum = k * g // per_gen // micro
    if per_gen > 1:
        settings["steps_per_generation"] = per_gen * accum
    gcfg = GRPOConfig(
        output_dir=str(out / f"{args.side}-out"), use_cpu=True, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum, num_generations=g, max_completion_length=new,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, learning_rate=lr,
        lr_scheduler_type="constant", shuffle_dataset=False, max_steps=max_steps, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=cfg.trainer.seed, **settings)
    rec = {"side": args.side, "machine": machine(), "points": [], "steps": [], "eval_s": 0.0,
           "trl": trl.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads(),
           "settings": {"bf16": gcfg.bf16, "gradient_checkpointing": gcfg.gradient_checkpointing,
                        "lr": lr, "loss_type": gcfg.loss_type, "beta": gcfg.beta,
                        "per_device_train_batch_size": micro,
                        "gradient_accumulation_steps": gcfg.gradient_accumulation_steps,
                        "steps_per_generation": gcfg.steps_per_generation,
                        "generation_batch_size": gcfg.generation_batch_size,
                        "prompt_tokens": [len(x) for x in held_ids[:3]]}}
    budget, every = args.budget_s, args.eval_every_s

    def evaluate(step: int, clock: float) -> None:
        t, c = time.perf_counter(), cpu_s()
        was = model.training
        model.eval()
        width = max(map(len, held_ids))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in held_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in held_ids])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 pad_token_id=pad, use_cache=True)
        texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        rewards = [float(score(env.extract(x), e)) for x, e in zip(texts, held, strict=True)]
        model.train(was)
        dt = time.perf_counter() - t
        rec["eval_s"] += dt
        rec["eval_cpu_s"] = rec.get("eval_cpu_s", 0.0) + cpu_s() - c
        point = {"step": step, "clock_s": clock, "pass1": sum(x >= 1 for x in rewards) / len(held),
                 "reward_mean": sum(rewards) / len(held), "n": len(held), "eval_s": dt,
                 "sample": texts[:2]}
        rec["points"].append(point)
        print(f"  eval after step {step}: pass@1 {point['pass1']:.3f} at {clock:.1f} s (eval {dt:.1f} s)",
              flush=True)

    clock = trl_clock(rec, budget, every, evaluate, start=lambda: evaluate(0, 0.0))
    t = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gcfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[clock])
    rec["construct_s"] = time.perf_counter() - t
    clock.attach(trainer)
    trainer.train()
    rec["machine_end"] = machine()
    (out / f"{args.side}.json").write_text(json.dumps(rec, indent=1))


def trl_clock(rec: dict, budget: float, every: float, point, *, start=lambda: None, extra=lambda m: {}):
    """A GRPOTrainer callback that keeps a TRL side's clock: `start()` before it starts (the point
    at 0 s), then each step into rec["steps"] (the clock without rec["eval_s"], the step's time
    and its generation's, CPU seconds, the sampled reward, `extra(trl's train metrics)`), and
    `point(step, clock)` after the first step past each multiple of `every` and after the step past
    `budget`, which stops the run. `attach(trainer)` once the trainer is built: it times
    `_generate_and_score_completions` (the step's generation)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        t0 = step_t0 = gen_s = 0.0
        nxt = every
        trainer = None

        def attach(self, trainer) -> None:
            self.trainer, generate = trainer, trainer._generate_and_score_completions

            def timed_generate(inputs):
                t = time.perf_counter()
                result = generate(inputs)
                self.gen_s += time.perf_counter() - t
                return result

            trainer._generate_and_score_completions = timed_generate

        def on_train_begin(self, a, state, control, **kw):
            start()  # before the clock starts
            self.t0, self.cpu0 = time.perf_counter(), cpu_s()
            rec["eval_s"] = rec["eval_cpu_s"] = 0.0  # what the clock excludes from here on

        def on_step_begin(self, a, state, control, **kw):
            self.step_t0, self.gen_s = time.perf_counter(), 0.0

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            clock = now - self.t0 - rec["eval_s"]
            metrics = self.trainer._metrics["train"]
            reward = float((metrics.get("reward") or [float("nan")])[-1])
            rec["steps"].append({"step": state.global_step, "clock_s": clock, "step_s": now - self.step_t0,
                                 "cpu_s": cpu_s() - self.cpu0 - rec["eval_cpu_s"],
                                 "gen_s": self.gen_s, "reward_mean": reward, **extra(metrics)})
            print(f"  step {state.global_step}: clock {clock:.1f} s, reward {reward:.3f}, "
                  f"step {now - self.step_t0:.1f} s (generation {self.gen_s:.1f} s)", flush=True)
            if clock >= budget:
                point(state.global_step, clock)
                control.should_training_stop = True
            elif clock >= self.nxt:
                point(state.global_step, clock)
                while self.nxt <= clock:
                    self.nxt += every

    return Clock()


# ------------------------------------------------------------------ the report
def first_reach(points: list[dict], target: float) -> float | None:
    return next((p["clock_s"] for p in points if p["pass1"] >= target - 1e-9), None)


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def report(out: Path) -> None:
    recs = {s: json.loads((out / f"{s}.json").read_text()) for s in SIDES if (out / f"{s}.json").is_file()}
    print(f"\n{out}")
    for side, rec in recs.items():
        m, e = rec["machine"], rec.get("machine_end", {})
        steps = rec["steps"]
        if side.startswith("tracetrain"):
            gen = median([s["collect_s"] for s in steps])
            rest = median([s["learn_s"] for s in steps])
            what = f"collect {gen:.1f} s, learn (rows + update + sync) {rest:.1f} s"
            prec = steps[-1]["precision"] if steps else "?"
            c = rec["config"]
            # (older records: overlap_collect)
            collect = "overlap" if c["trainer"].get("overlap_collect") else c["trainer"]["collect"]
            what += (f"; precision {prec}, collect {collect}, "
                     f"lr {c['optim']['lr']}, mini_batches {c['optim']['mini_batches']}")
        else:
            gen = median([s["gen_s"] for s in steps])
            rest = median([s["step_s"] - s["gen_s"] for s in steps])
            st = rec["settings"]
            what = (f"generation {gen:.1f} s, rest of the step {rest:.1f} s; bf16 {st['bf16']}, "
                    f"gradient checkpointing {st['gradient_checkpointing']}, lr {st['lr']}")
        per_step = (steps[-1]["clock_s"] / len(steps)) if steps else float("nan")
        if steps and "cpu_s" in steps[-1]:
            what += f"; CPU {steps[-1]['cpu_s'] / steps[-1]['clock_s']:.2f} cores busy on average"
        print(f"\n{side}: {len(steps)} steps, {per_step:.1f} s per step (clock / steps); medians: {what}")
        if "prompt_check" in rec:
            pc = rec["prompt_check"]
            print(f"  prompt ids: {pc['same_ids']} of {pc['turns']} recorded first turns are the ids "
                  "GRPOTrainer makes of the same messages")
        print(f"  {m['utc']} UTC, load average at start {m['loadavg'][0]:.2f}, at end "
              f"{e.get('loadavg', [float('nan')])[0]:.2f}; evals took {rec['eval_s']:.0f} s (excluded)")
        print("  " + "  ".join(f"{p['clock_s']:.0f}s:{p['pass1']:.3f}" for p in rec["points"]))
    for tt, peer in (("tracetrain-best", "trl-best"), ("tracetrain-defaults", "trl-defaults"),
                     ("tracetrain-defaults", "trl-best"), ("tracetrain-best", "trl-defaults")):
        if tt not in recs or peer not in recs:
            continue
        tp, pp = recs[tt]["points"], recs[peer]["points"]
        target, t_end = pp[-1]["pass1"], pp[-1]["clock_s"]
        t_first = first_reach(pp, target)
        reach = first_reach(tp, target)
        line = (f"\n{tt} vs {peer}: untrained {tp[0]['pass1']:.3f} / {pp[0]['pass1']:.3f}; {peer}'s "
                f"final pass@1 {target:.3f} at {t_end:.0f} s")
        if reach is None:
            line += f"; {tt} never reached it (its best {max(p['pass1'] for p in tp):.3f})"
        else:
            line += (f"; {tt} reached it at {reach:.0f} s: ratio {reach / t_end:.2f} "
                     f"(vs {peer}'s first point at it, {t_first:.0f} s: {reach / max(t_first, 1e-9):.2f})")
        print(line)
    print("goal: tracetrain's time to reach TRL's final held-out pass@1 / TRL's time <= 0.5")


# ------------------------------------------------------------------ the driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(CONFIG), help="the task (and tracetrain's best settings)")
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=SIDES)
    ap.add_argument("--budget-s", type=float, default=900.0,
                    help="training wall seconds per side (evals excluded)")
    ap.add_argument("--eval-every-s", type=float, default=120.0)
    ap.add_argument("--tt-set", nargs="*", default=[],
                    help="overrides of tracetrain-best alone (e.g. optim.lr=3e-5)")
    ap.add_argument("--trl-lr", type=float, default=1e-5, help="trl-best's lr")
    ap.add_argument("--defaults-lr", type=float, default=1e-5, help="the lr of both defaults sides")
    ap.add_argument("--trl-bf16", action="store_true",
                    help="trl-best keeps bf16 autocast (the default's) and only turns gradient "
                         "checkpointing off: faster where the CPU has AVX-512 BF16")
    ap.add_argument("--trl-micro", type=int, default=8,
                    help="trl-best's per_device_train_batch_size (trl-defaults: 8, the default)")
    ap.add_argument("--trl-steps-per-generation", type=int, default=None,
                    help="trl-best: optimizer steps per generation batch (default: one)")
    ap.add_argument("--trl-max-steps", type=int, default=2000,
                    help="TRL's max_steps (the budget ends it first)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (key=value) for every side")
    ap.add_argument("--out", default=None, help="the results' folder (default runs/bench_env_trl/<time>)")
    ap.add_argument("--report", default=None, help="print the report of a results folder and exit")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    out = Path(args.out or ROOT / "runs" / "bench_env_trl" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    if args.side:
        (run_tracetrain if args.side.startswith("tracetrain") else run_trl)(args, out)
        return
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    passthrough = [a for a in sys.argv[1:]]
    if "--sides" in passthrough:  # the children get --side
        i = passthrough.index("--sides")
        j = i + 1
        while j < len(passthrough) and not passthrough[j].startswith("--"):
            j += 1
        del passthrough[i:j]
    for side in args.sides:
        print(f"== {side} ({time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.2f})", flush=True)
        argv = [sys.executable, __file__, *passthrough, "--out", str(out), "--side", side]
        subprocess.run(argv, check=True, env=env)
    report(out)


if __name__ == "__main__":
    main()
