"""One RL training step, tracetrain vs TRL's GRPOTrainer on the same work, side by side; and the
trained-forward tokens of trajectory vs transition aggregation on 8-turn rollouts.

    .venv/bin/python bench/bench_train_step.py                    # 8 timed steps per side
    .venv/bin/python bench/bench_train_step.py --repeats 20       # the figures in docs/bench-train.md
    .venv/bin/python bench/bench_train_step.py --threads 0        # torch's default thread count
    .venv/bin/python bench/bench_train_step.py --no-trl           # tracetrain figures only
    .venv/bin/python bench/bench_train_step.py --overlap --trl-threads 2   # both sides on 2 cores

The work of one step (both sides): the tiny Llama of `tracetrain.models.tiny` (hidden 256, 4 layers,
4 heads / 2 KV heads, tied embeddings: 3.08M parameters, the same initial weights), CPU, fp32;
1 prompt ("Write a long number." as a chat message, the same prompt ids) x 8 samples x exactly 64
new tokens at temperature 1; reward = fraction of digits in the decoded reply
(bench/tasks/one_turn.py, the same function on both sides); group-normalised advantages; one
forward + backward over the 8 rows, gradient clipping at 1.0, one fused AdamW step (torch's
kernel on both sides: TRL's default optim `adamw_torch_fused`, tracetrain's `optim.adamw`). No
reference model (KL coefficient 0), no gradient checkpointing.

Equal work, 64 tokens every time: tracetrain's engine is given no stop ids (an eos may be sampled
but does not end the row); TRL gets `generation_kwargs={"min_new_tokens": 64}` (eos masked until
64 tokens). Both sides print the generated and trained token counts of every step, and the bench
fails if either is not 8 x 64.

tracetrain's step is one step of the run loop (`Trainer.steps`' collect -> rows -> update ->
sync, run one at a time by `Stepper` with the trainer's collector, learner and weight sync), on
the run's services (run/services.py): the runner creates the 8 rollouts on the in-process gateway
(uvicorn on 127.0.0.1), 8 agents call it with the openai SDK, the local engine decodes them as one
batch, turns go to SQLite, then aggregate -> advantages -> drain -> PPO update -> version bump.
TRL's step is the time between its `on_step_begin` and `on_step_end` callbacks (generation with
transformers `generate`, reward, advantages, loss forward + backward, clip, optimizer step); TRL's
work between two steps (logging hooks, the next batch from the dataloader) is printed apart as
"between steps".

TRL runs in a child process with the interpreter of the peers env (bench/.venv-peers, see
bench/setup_peers.sh), driven one step at a time over a pipe, so the two sides never run at the
same time: round r = one tracetrain step and one TRL step, back to back, who goes first
alternating. One warm-up step each first. The machine is shared: min and median are printed,
their ratios, and the median over rounds of the round's own ratio (the two steps of a round see
about the same load).

Threads: both sides use 1 torch thread by default (--threads). On a small shared machine, 2
intra-op threads made these tiny matmuls 5-10x slower and erratic whenever other jobs ran (OpenMP
workers waiting on busy cores), which would measure the load, not the trainers.

Generated tokens/s = generated tokens / the generation phase (tracetrain: the collect phase, from
the first rollout created to the last agent done; TRL: `_generate_and_score_completions`);
trained tokens/s = trained tokens / the training phase (tracetrain: advantages + drain + PPO
update + version bump; TRL: the rest of its step). tracetrain's step is also split into engine
decode (timed around the engine's decode loops), the gateway/runner/agent work around it, store
read + aggregate, and the update; a step whose 8 requests were decoded in more than one loop is
reported.

Aggregation: 64 synthetic 8-turn rollouts rendered with the tiny tokenizer's chat template the way
the gateway renders them (the prompt of turn k = the whole previous conversation + the new
observation), in two shapes: the guess game (short replies) and an agent with ~40-token replies
and ~40-token observations. Trained-forward tokens = attention_mask.sum() of the batch (the
non-pad tokens the trainer forwards); cells = the padded [rows, P+R] size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / "bench" / ".venv-peers" / "bin" / "python"
TASK_FILE = ROOT / "bench" / "tasks" / "one_turn.py"
N_SAMPLES, N_NEW = 8, 64
STEAL = 0.05  # rounds with at least this share of host steal get their own ratio
MARK = "BENCH "  # prefix of the child's protocol lines on stdout (anything else is ignored)


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat's `cpu` line; empty where there is none)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(before: list[int], after: list[int]) -> float:
    """Share of all CPU time between two cpu_times() the hypervisor took (steal, 8th field):
    the bench's tracetrain was measured slower than TRL only in hours with 13-18% steal."""
    if len(before) < 8 or len(after) < 8:
        return float("nan")
    d = [a - b for a, b in zip(after, before, strict=False)]
    return d[7] / max(1, sum(d[:8]))


def load_one_turn():
    from tracetrain.agents.tasks import load_task as load

    return load(str(TASK_FILE))


# ------------------------------------------------------------------ TRL side (peers interpreter)
def trl_worker(args: argparse.Namespace) -> None:
    """Train with GRPOTrainer for 1 + repeats steps; each step waits for a "go" line on stdin and
    reports a `BENCH {json}` line on stdout when it ends."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    one_turn = load_one_turn()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    steps = 1 + args.repeats
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": one_turn.PROMPT}]}] * steps)

    def digits(completions, **_):
        return [
            one_turn.digit_fraction(c[-1]["content"] if isinstance(c, list) else c)
            for c in completions
        ]

    cfg = GRPOConfig(
        output_dir=args.out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=N_SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=N_SAMPLES,
        generation_batch_size=N_SAMPLES,  # one generation batch = one optimizer step
        num_iterations=1,
        max_completion_length=N_NEW,
        generation_kwargs={"min_new_tokens": N_NEW},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # TRL's default; tracetrain's optim.adamw is fused too
        max_steps=steps,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.t_end, self.gen_s, self.gen_tokens, self.prompt_tokens = None, 0.0, 0, 0

        def on_step_begin(self, args_, state, control, **kw):
            gap = None if self.t_end is None else time.perf_counter() - self.t_end
            if sys.stdin.readline().strip() != "go":
                os._exit(0)
            self.gap, self.gen_s, self.gen_tokens = gap, 0.0, 0
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            self.t_end = time.perf_counter()
            row = {
                "step_s": self.t_end - self.t0,
                "gen_s": self.gen_s,
                "gen_tokens": self.gen_tokens,
                "trained_tokens": self.gen_tokens,
                "prompt_tokens": self.prompt_tokens,
                "between_s": self.gap,
            }
            print(MARK + json.dumps(row), flush=True)

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digits,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs):
        t = time.perf_counter()
        out = generate(inputs)
        clock.gen_s += time.perf_counter() - t
        clock.gen_tokens += int(out["completion_mask"].sum())  # the tokens the loss trains
        clock.prompt_tokens = int(out["prompt_mask"][0].sum())
        return out

    trainer._generate_and_score_completions = timed_generate
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(
        MARK + json.dumps({"ready": True, "params": n_params, "threads": torch.get_num_threads()}),
        flush=True,
    )
    trainer.train()


class TRLPeer:
    """The TRL child process, driven one step at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path):
        self.proc, self.stderr_path = proc, stderr_path

    @classmethod
    async def start(cls, model_dir: Path, work: Path, args: argparse.Namespace, *,
                    script: str = __file__, extra: tuple[str, ...] = (), name: str = "trl") -> TRLPeer:
        """`script --trl-worker ...` under the peers interpreter (`extra`: more arguments; `name`:
        its output folder and stderr file in `work`)."""
        argv = [
            str(PEER_PYTHON),
            str(Path(script).resolve()),
            "--trl-worker",
            "--model-dir",
            str(model_dir),
            "--out-dir",
            str(work / f"{name}-out"),
            "--repeats",
            str(args.repeats),
            "--lr",
            str(args.lr),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.trl_threads),
            *extra,
        ]
        err = work / f"{name}.stderr"
        err_file = err.open("wb")
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err_file,
            env=env,
        )
        err_file.close()  # the child has its own copy
        return cls(proc, err)

    async def read(self, timeout_s: float) -> dict:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            if not line:
                tail = self.stderr_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"TRL worker ended (exit {await self.proc.wait()}):\n{tail}")
            text = line.decode(errors="replace")
            if text.startswith(MARK):
                return json.loads(text[len(MARK) :])

    async def step(self, timeout_s: float = 600) -> dict:
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()
        return await self.read(timeout_s)

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), 60)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                self.proc.kill()
                await self.proc.wait()


# ------------------------------------------------------------------ tracetrain side
def bench_config(run_dir: Path, args: argparse.Namespace):
    from tracetrain.config import build_config

    return build_config(
        {
            "task": str(TASK_FILE),
            "model": {
                "kind": "tiny",
                "hidden_size": 256,
                "num_layers": 4,
                "num_heads": 4,
                "num_kv_heads": 2,
            },
            "rollout": {
                "tasks_per_step": 1,
                "n_per_task": N_SAMPLES,
                "temperature": 1.0,
                "max_tokens": N_NEW,
                "timeout_s": 300.0,
            },
            "aggregate": {"level": "trajectory"},
            "advantage": {"estimator": "grpo"},
            "optim": {
                "lr": args.lr,
                "warmup_steps": 0,
                "decay": "constant",
                "grad_clip": 1.0,
                "mini_batches": 1,
                "ppo_epochs": 1,
            },
            "trainer": {"steps": 10_000, "seed": args.seed, "run_dir": str(run_dir),
                        "collect": "overlap" if args.overlap else "step",
                        "max_staleness": int(args.overlap)},
        }
    )


def time_decoding(engine) -> None:
    """Measurement only: add each decode loop's seconds to engine.stats["decode_s"]."""
    run = engine._run
    engine.stats["decode_s"] = 0.0

    def timed(reqs, *join):
        t = time.perf_counter()
        try:
            return run(reqs, *join)
        finally:
            engine.stats["decode_s"] += time.perf_counter() - t

    engine._run = timed


class Stepper:
    """The embedded trainer's steps one at a time: `step()` runs the next step as `Trainer.steps`
    does (run/trainer.py) with the trainer's own pieces: its collector of trainer.collect
    (run/collectors.py: take, taken, synced), its learner's rows and update (run/learner.py) on
    its update thread, its WeightSync's held update window and version bump (run/weights.py);
    no eval, checkpoint or metrics line. Returns the step's metrics as the loop logs them.
    `settle()` waits for what the step left running (collect overlap: the next step's collect)."""

    def __init__(self, trainer, play):
        from tracetrain.run.collectors import collector_for
        from tracetrain.run.step import EngineClock

        self.trainer, self.play, self.engine = trainer, play, play.services.engine
        self.collector = collector_for(play, trainer.sync, trainer.stop, trainer.log)
        self.collector.start(trainer.state)
        self.clock, self.collected = EngineClock(trainer.sync.slot, self.engine), None

    async def step(self) -> dict:
        from tracetrain.run.memory import peak_rss_gb, reset_peak
        from tracetrain.run.step import engine_metrics, throughput

        tr, st, svc, out = self.trainer, self.trainer.state, self.play.services, self.collector
        self.collected = got = await out.take(st, self.clock)  # collect
        await out.taken(st)
        rows, work = tr.learner.rows(svc.store, got.results, st.version)  # rows
        m = {"step": st.step, **rows.metrics, **got.metrics, **engine_metrics(got.engine_work)}
        t = time.perf_counter()
        if trained := bool(rows.batch.n_rows):  # update
            run = functools.partial(tr.update_thread.update, tr.learner.update, work,
                                    measure_gap=got.engine_version == st.version)
            updates, times = await tr.sync.run_update(svc.gateway, run, st.version + 1)
            st.version += 1
            m |= {**times, **tr.learner.update_metrics(updates)}
        for k, v in (await out.synced(st, updated=trained)).items():  # sync (as Trainer.steps)
            m[k] = m.get(k, 0.0) + v
        m |= {"model_version": st.version, "memory/peak_rss_gb": peak_rss_gb(),
              **throughput(len(got.results), rows.batch, got.seconds, time.perf_counter() - t)}
        reset_peak()
        st.step += 1
        return m

    async def settle(self) -> None:
        pending = getattr(self.collector, "pending", None)
        if pending is not None:
            await asyncio.wait([pending])

    async def close(self) -> None:
        await self.collector.close(self.trainer.state, self.collected)


@contextlib.asynccontextmanager
async def serving(trainer):
    """Trainer.run's set-up without warm start, eval or checkpoints: the run's services
    (run/services.started: the store in the run dir, a local engine on the engine's copy of the
    weights if the trainer keeps one, else on the policy, the in-process gateway on 127.0.0.1,
    the agents' HTTP client kept across steps), the engine made to never stop before max_tokens
    and to time its decode loops. Yields a Stepper on them."""
    from tracetrain.agents.tasks import resolve_agent
    from tracetrain.gateway.inprocess import admin_key_for
    from tracetrain.models.compute import one_thread_here
    from tracetrain.run import services
    from tracetrain.run.collectors import Play

    cfg, task = trainer.cfg, trainer.task
    try:  # (as Trainer.run: the event loop's thread has no OpenMP team, models/compute.py)
        with one_thread_here():
            async with services.started(
                    cfg, trainer.learner, trainer.sync, version=trainer.state.version, task=task,
                    run_dir=trainer.run_dir, threads=trainer.update_thread.threads,
                    lockstep=trainer.lockstep, admin_key=admin_key_for(cfg.gateway.host),
                    log=trainer.log) as svc:
                svc.engine.stop_ids = frozenset()  # no stop: every sample is max_tokens long
                time_decoding(svc.engine)
                play = Play(cfg, task, trainer.data, resolve_agent(task, cfg.agent), trainer.nonce,
                            trainer.lockstep, svc)
                stepper = Stepper(trainer, play)
                try:
                    yield stepper
                finally:
                    await stepper.close()
    finally:
        trainer.update_thread.close()


async def tracetrain_step(stepper: Stepper) -> dict:
    """One step: `Stepper.step` (Trainer.steps' collect -> rows -> update -> sync); with
    --overlap, one steady-state round of the overlapping loop: the step trains the rollouts the
    last round collected, the engine takes the last update's weights, step k+1's collect runs
    while step k's update does, and the round ends when both have (so that nothing of ours runs
    during TRL's step)."""
    engine = stepper.engine
    before = dict(engine.stats)
    t = time.perf_counter()
    m = await stepper.step()
    await stepper.settle()
    step_s = time.perf_counter() - t
    n_tok = int(m["aggregate/tokens/trained"])
    return {
        "step_s": step_s,
        "gen_s": m["time/collect_s"],
        "train_s": m["time/train_s"],
        "update_s": m["time/update_s"],
        "decode_s": engine.stats["decode_s"] - before["decode_s"],
        "decode_loops": engine.stats["batches"] - before["batches"],
        "gen_tokens": n_tok,
        "trained_tokens": n_tok,
        "reward": m["reward_mean"],
        "version": m["model_version"],
    }


async def run_steps(
    args: argparse.Namespace, work: Path
) -> tuple[list[dict], list[dict] | str, dict]:
    import torch

    from tracetrain.models import tiny
    from tracetrain.run.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    task = load_one_turn()
    trainer = Trainer(bench_config(work / "run", args), task, log=lambda *_: None)
    model, tok = trainer.learner.model, trainer.learner.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    model_dir = tiny.save_tiny(work / "model", tok, model)  # TRL's copy
    prompt_ids = tok.apply_chat_template(
        [{"role": "user", "content": task.PROMPT}], add_generation_prompt=True
    )["input_ids"]
    info = {
        "overlap": args.overlap,
        "params": n_params,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
    }

    peer: TRLPeer | None = None
    trl_rows: list[dict] | str
    if args.no_trl:
        trl_rows = "skipped (--no-trl)"
    elif not PEER_PYTHON.exists():
        trl_rows = f"unavailable: no peers env at {PEER_PYTHON} (run bench/setup_peers.sh)"
    else:
        peer = await TRLPeer.start(model_dir, work, args)
        trl_rows = []

    tt_rows: list[dict] = []
    try:
        async with serving(trainer) as stepper:
            engine = stepper.engine
            await tracetrain_step(stepper)  # warm-up
            if peer is not None:
                try:
                    ready = await peer.read(600)
                    info["trl_params"], info["trl_threads"] = ready["params"], ready["threads"]
                    await peer.step()  # warm-up
                except (RuntimeError, TimeoutError) as e:
                    await peer.close()
                    trl_rows, peer = f"failed: {e}", None
            for r in range(args.repeats):
                # Alternate who goes first (ABBA...), so neither side always runs right
                # after the other: a slow patch of the shared machine hits both alike.
                order = ("tt", "trl") if r % 2 == 0 else ("trl", "tt")
                line, cpu_before = [], cpu_times()
                for side in order:
                    if side == "tt":
                        tt_rows.append(await tracetrain_step(stepper))
                        x = tt_rows[-1]
                        line.append(f"tracetrain {x['step_s']:.3f} s ({x['decode_loops']} decode "
                                    f"loop{'s' * (x['decode_loops'] > 1)})")
                    elif peer is not None:
                        try:
                            trl_rows.append(await peer.step())
                            line.append(f"TRL {trl_rows[-1]['step_s']:.3f} s")
                        except (RuntimeError, TimeoutError) as e:
                            await peer.close()
                            trl_rows, peer = f"failed: {e}", None
                steal = steal_share(cpu_before, cpu_times())
                tt_rows[-1]["steal"] = steal
                print(f"  round {r + 1}/{args.repeats}: {', '.join(line)}  "
                      f"(load average {os.getloadavg()[0]:.1f}, host steal {steal:.0%})",
                      flush=True)
    finally:
        if peer is not None:
            await peer.close()
    info["engine"] = dict(engine.stats)
    return tt_rows, trl_rows, info


# ------------------------------------------------------------------ aggregation tokens
WORDS = (
    "the of and to in is it that for on with as was at by this from or an be are have not "
    "result value check file test call tool run step error list read open next then done"
).split()


def chat_rollouts(tok, n: int, *, long: bool, seed: int = 0, turns: int = 8):
    """n rollouts of `turns` turns; each prompt is the chat template over the whole conversation so
    far (how the gateway renders an agent's request), each response the reply's ids + eos."""
    from tracetrain.types import Rollout, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.randint(1, 100)
        msgs = [
            {"role": "system", "content": "Guess my number from 1 to 100."},
            {"role": "user", "content": "Guess."},
        ]
        rollout_turns = []
        for _ in range(turns):
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
            guess = rng.randint(1, 100)
            reply = str(guess)
            if long:  # some reasoning before the answer, like a tool-using agent
                reply = " ".join(rng.choice(WORDS) for _ in range(40)) + f" {guess}"
            response = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
            rollout_turns.append(Turn(prompt, response, [-1.0] * len(response), 0))
            obs = "higher" if guess < target else "lower" if guess > target else "correct"
            if long:
                obs = f"{obs}. " + " ".join(rng.choice(WORDS) for _ in range(40))
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
        out.append(Rollout(f"r{i}", f"g{i // 8}", rollout_turns, reward=float(rng.random())))
    return out


def aggregation_tokens(n: int = 64) -> list[dict]:
    from tracetrain.models.tiny import build_tokenizer
    from tracetrain.rows.aggregate import aggregate

    tok = build_tokenizer()
    rows = []
    for shape, long in (
        ("guess chat, 8 turns (short replies)", False),
        ("agent chat, 8 turns (~40-token turns)", True),
    ):
        rollouts = chat_rollouts(tok, n, long=long)
        res = {"shape": shape}
        for level in ("transition", "trajectory"):
            batch, m = aggregate(
                rollouts,
                level=level,
                max_prompt_length=8192,
                max_response_length=8192,
                pad_token_id=tok.pad_token_id,
                tokenizer=tok,
            )
            res[level] = {
                "rows": batch.n_rows,
                "forward": int(batch.attention_mask.sum()),
                "cells": batch.attention_mask.numel(),
                "trained": int(batch.response_mask.sum()),
                "breaks": int(m.get("breaks/total", 0)),
            }
        rows.append(res)
    return rows


# ------------------------------------------------------------------ report
def summarize(rows: list[dict], key: str) -> tuple[float, float]:
    xs = [r[key] for r in rows]
    return min(xs), statistics.median(xs)


def check_work(name: str, rows: list[dict]) -> None:
    want = N_SAMPLES * N_NEW
    bad = [r for r in rows if r["gen_tokens"] != want or r["trained_tokens"] != want]
    if bad:
        raise SystemExit(
            f"{name}: a step did not generate and train exactly {want} tokens: {bad[0]}"
        )


def report(tt: list[dict], trl: list[dict] | str, info: dict, agg: list[dict]) -> None:
    check_work("tracetrain", tt)
    for r in tt:
        r["rest_s"] = r["step_s"] - r["gen_s"]  # everything after generation: store, rows, update
    n = N_SAMPLES * N_NEW
    trl_params = f" / {info['trl_params'] / 1e6:.2f}M (TRL)" if "trl_params" in info else ""
    trl_threads = f" / {info['trl_threads']} (TRL)" if "trl_threads" in info else ""
    print(
        f"\nmodel {info['params'] / 1e6:.2f}M params (tracetrain){trl_params}, fp32, CPU, "
        f"torch threads {info['threads']}{' decode + 1 update, overlapped' if info['overlap'] else ''}"
        f"{trl_threads}; "
        f"1 prompt ({info['prompt_tokens']} tokens) x {N_SAMPLES} samples x {N_NEW} new tokens; "
        f"{len(tt)} timed steps per side"
    )
    head = (
        f"{'':28s} {'step s min':>10s} {'median':>8s} {'gen s med':>9s} {'rest s med':>10s} "
        f"{'gen tok/s':>9s} {'train tok/s':>11s}"
    )
    print(head)

    def line(name, rows):
        lo, med = summarize(rows, "step_s")
        g = statistics.median(r["gen_s"] for r in rows)
        rest = statistics.median(r["rest_s"] for r in rows)
        tr = statistics.median(r["train_s"] for r in rows)
        print(f"{name:28s} {lo:10.3f} {med:8.3f} {g:9.3f} {rest:10.3f} {n / g:9.0f} {n / tr:11.0f}")
        return lo, med

    name = "tracetrain overlapped step" if info["overlap"] else "tracetrain Trainer.train_step"
    tt_lo, tt_med = line(name, tt)
    if isinstance(trl, list) and trl:
        check_work("TRL", trl)
        for r in trl:
            r["train_s"] = r["rest_s"] = r["step_s"] - r["gen_s"]
        trl_lo, trl_med = line("TRL GRPOTrainer step", trl)
        between = [r["between_s"] for r in trl if r["between_s"] is not None]
        if between:
            print(
                f"{'  (TRL between steps)':28s} {min(between):10.3f} {statistics.median(between):8.3f}"
            )
        # The two steps of one round ran back to back: their ratio cancels slow drifts of load.
        paired = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(tt, trl, strict=False))
        print(
            f"ratio TRL / tracetrain step time: {trl_lo / tt_lo:.2f}x (min), {trl_med / tt_med:.2f}x "
            f"(median), {paired:.2f}x (median of the rounds' ratios)  -> tracetrain is "
            f"{'faster' if paired > 1 else 'as fast' if paired == 1 else 'slower'} (goal: >= 1.00x)"
        )
        stolen = [b["step_s"] / a["step_s"] for a, b in zip(tt, trl, strict=False)
                  if a.get("steal", 0) >= STEAL]
        if stolen:
            print(f"  {len(stolen)} rounds under host steal >= {STEAL:.0%}: median of their ratios "
                  f"{statistics.median(stolen):.2f}x")
    else:
        print(f"TRL GRPOTrainer: {trl}")
    if info["overlap"]:
        print("  (overlapped: a step's wall time is the weight swap + the longer of its update and "
              "the next step's collect; gen s is that collect alone, rest s is not a phase)")
    for r in tt:  # per step, then the median of each part
        r["around_s"] = r["gen_s"] - r["decode_s"]
        r["store_s"] = r["step_s"] - r["gen_s"] - r["train_s"]
    med = {
        k: statistics.median(r[k] for r in tt)
        for k in ("decode_s", "around_s", "store_s", "train_s", "update_s")
    }
    store = "overlapped" if info["overlap"] else f"{med['store_s']:.3f} s"
    print(
        f"tracetrain step parts, medians: engine decode {med['decode_s']:.3f} s | gateway + runner + "
        f"agents around it {med['around_s']:.3f} s | store read + aggregate {store} | "
        f"advantages + drain + PPO update + version bump {med['train_s']:.3f} s, of which the "
        f"update (ppo_update) {med['update_s']:.3f} s"
    )
    split = [r for r in tt if r["decode_loops"] > 1]
    if split:
        one = [r["step_s"] for r in tt if r["decode_loops"] == 1]
        print(
            f"  {len(split)} of {len(tt)} steps decoded the 8 requests in more than one loop "
            f"(median step {statistics.median(r['step_s'] for r in split):.3f} s vs "
            f"{statistics.median(one) if one else float('nan'):.3f} s in one loop)"
        )
    print(f"engine stats: {info['engine']}")

    print(
        f"\n{'aggregation (64 rollouts)':40s} {'level':>10s} {'rows':>5s} {'forward tok':>11s} {'cells':>8s} "
        f"{'trained':>8s} {'breaks':>6s}"
    )
    for a in agg:
        for level in ("transition", "trajectory"):
            x = a[level]
            print(
                f"{a['shape']:40s} {level:>10s} {x['rows']:5d} {x['forward']:11d} {x['cells']:8d} "
                f"{x['trained']:8d} {x['breaks']:6d}"
            )
        ratio = a["transition"]["forward"] / a["trajectory"]["forward"]
        print(
            f"{'':40s} transition / trajectory forward tokens: {ratio:.2f}x (goal >= 2x); "
            f"cells {a['transition']['cells'] / a['trajectory']['cells']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--repeats", type=int, default=8, help="timed steps per side (after one warm-up)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (0: torch's default; see the module docstring)",
    )
    ap.add_argument(
        "--trl-threads", type=int, default=None, help="TRL's torch threads (default: --threads)"
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="tracetrain with trainer.collect overlap (the next step's collect during the update)",
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trl", action="store_true", help="tracetrain figures only")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_threads is None:
        args.trl_threads = args.threads
    if args.trl_worker:
        trl_worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        tt, trl, info = asyncio.run(run_steps(args, Path(tmp)))
    report(tt, trl, info, aggregation_tokens())


if __name__ == "__main__":
    main()
