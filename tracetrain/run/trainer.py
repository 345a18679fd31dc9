"""The embedded trainer: one process, one machine, the whole loop.

    for step in 1..steps:
        tasks -> n rollouts per task (a group) -> agents call the gateway -> turns in the store
        aggregate(turns) -> rows;  advantages per rollout;  stale turns excluded
        for epoch: for mini-batch (whole rollouts): sum over micro-batches of L_micro -> backward
                   clip grad norm -> AdamW step -> lr schedule
        drain the engine (hold new requests, wait for those in flight), bump model_version,
        resume;  metrics -> JSONL;  checkpoint

The policy module is shared by the engine and the optimizer: the weight update is in place, so the
"sync" is a version bump done while the gateway holds new requests (pause) and no request is in
flight (drain).

trainer.collect overlap: the engine keeps its own copy of the weights, and step k+1's rollouts are
collected while step k's update runs, by the policy before that update (one version old: PPO's
ratio uses the logprobs the engine recorded). Between two collects the engine takes the new
weights (pause, drain, load, resume). On two cores this fills the core the update leaves idle.

engine.kind vllm: a vLLM server generates (engines/vllm.py); it always has its own copy of the
weights, so after every update (or, with collect overlap, between two collects) they are pushed
to it the same way: pause, drain, write + reload, resume. Under LoRA the server holds the base
weights from its launch and the push is the adapter alone (LoraTransport).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tracetrain.agents.lockstep import Lockstep
from tracetrain.agents.runner import GatewayClient, RolloutResult
from tracetrain.agents.tasks import load_source, open_task_data, resolve_agent
from tracetrain.agents.workers import AgentWorkers
from tracetrain.config import ConfigError, TrainConfig
from tracetrain.engines.start import preflight
from tracetrain.gateway.inprocess import admin_key_for
from tracetrain.learn.distributed import DataParallel, from_main, wrap, wrap_policies
from tracetrain.learn.optim import optimizer_and_schedule
from tracetrain.learn.update import UpdateStopped, ppo_update
from tracetrain.models import lora
from tracetrain.models.compute import compute_thread, on_compute, one_thread_here, run_with_threads
from tracetrain.run import checkpoint, continuous, policies, services
from tracetrain.run.evaluate import eval_samples, eval_tasks
from tracetrain.run.memory import peak_rss_gb, reset_peak
from tracetrain.run.precision import resolve_precision
from tracetrain.run.rundir import claim_run_dir, format_step, rewrite_metrics
from tracetrain.run.step import (
    ENGINE_WORK,
    Collected,
    EngineClock,
    build_rows,
    check_top_p,
    collect,
    collected_of,
    end_unfinished,
    engine_metrics,
    rollout_specs,
    step_tasks,
    throughput,
    update_metrics,
)
from tracetrain.run.stop import Stop, Stopped
from tracetrain.run.trackers import NO_TRACKERS, open_trackers
from tracetrain.run.weights import WeightSync

log = logging.getLogger("tracetrain.trainer")
STOPPED = "stopped"  # what rank 0 sends the other ranks instead of a step's rows when it stopped


def train(cfg: TrainConfig, *, base_dir: Path | None = None, log=print) -> dict:
    """Run the whole job; writes metrics.jsonl, checkpoint.pt, curve.png and summary.json."""
    from tracetrain.learn import distributed
    from tracetrain.run.report import plot_curves, summary

    task = load_source(cfg, base_dir)  # a task module, or an environment (tracetrain/envs)
    data = open_task_data(cfg, base_dir, task)  # every row checked before any training
    if (cfg.trainer.eval_every and data is not None and data.eval_rows is None
            and not callable(getattr(task, "tasks", None))):
        raise ConfigError("config key 'trainer.eval_every': the eval passes need held-out rows "
                          "(data.eval or data.eval_fraction) or the task module's `tasks`")
    dp = distributed.init_from_env()  # under torchrun: one process per rank (distributed.py)
    trainer = None
    try:
        trainer = Trainer(cfg, task, data, log=log, dp=dp)
        t = time.perf_counter()
        history = asyncio.run(trainer.run())
    finally:
        if trainer is not None:  # the DDP wrapper goes before the group (distributed.close)
            trainer.policy = trainer.model
        distributed.close(dp)
        if cfg.env is not None:  # what the environment opened in this process (a server)
            task.close()
    if not dp.is_main:
        return {}
    out = summary(history, target_gain=cfg.trainer.target_gain, cancelled_at_end=trainer.cancelled_at_end)
    out["wall_s"] = time.perf_counter() - t
    task_file = getattr(task, "__file__", None) if cfg.task.endswith(".py") else None
    name = Path(task_file).resolve().parent.name if task_file else cfg.task
    out["curve"] = str(plot_curves(history, trainer.run_dir / "curve.png",
                                   title=f"{name}: {cfg.agent} ({cfg.trainer.run_dir})"))
    (trainer.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    log("summary: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    return out


class Trainer:
    """Owns the policy, the engine, the store and the in-process gateway of one run."""

    trackers = NO_TRACKERS  # trainer.report_to's, while `run` runs (run/trackers.py)

    def __init__(self, cfg: TrainConfig, task_module: Any, data=None, *, log=print,
                 dp: DataParallel = DataParallel()):
        from tracetrain.models.load import load_policy

        self.cfg, self.task, self.dp = cfg, task_module, dp
        self.data = data  # the run's dataset (dataset.TaskData), when it has one
        self.log = log if dp.is_main else (lambda *a, **k: None)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.engine.threads:
            torch.set_num_threads(cfg.engine.threads)
        # Torch threads where the model runs (per OS thread: models/compute.py): `threads` the
        # engine's decoding, `update_threads` the update, the larger the load and the warm start.
        self.threads = cfg.engine.threads or torch.get_num_threads()
        self.update_threads = cfg.trainer.update_threads or self.threads
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        self.model, self.tokenizer = on_compute(  # where the model runs (models/compute.py)
            max(self.threads, self.update_threads), load_policy, cfg.model, seed=cfg.trainer.seed)
        if cfg.model.lora is not None:  # the base frozen, a fresh adapter (lora.py)
            self.model = lora.wrap(self.model, cfg.model.lora)
        # several policies (run/policies.py): whole-model ones' models; the others' adapters
        self.whole = policies.whole_models(cfg, self.model, self.tokenizer) if cfg.policies else {}
        if cfg.adapter_policies:
            self.model = lora.wrap_policies(self.model, cfg.adapter_policies)
        if cfg.trainer.device != "cpu":
            if not torch.cuda.is_available():
                raise ConfigError(f"config key 'trainer.device': {cfg.trainer.device!r}, and this "
                                  "machine has no CUDA device")
            for m in (self.model, *self.whole.values()):
                m.to(cfg.trainer.device)
        # what the update's forward runs: the model, DDP around it under torchrun; several
        # policies: {policy: that} (distributed.wrap_policies)
        self.policy: torch.nn.Module | dict[str, torch.nn.Module] = self.model
        # AdamW and its schedule; several policies: one each, by policy (policies.ByPolicy)
        self.optimizer, self.scheduler = (
            policies.optimizers(cfg, self.model, self.whole) if cfg.policies is not None else
            optimizer_and_schedule(lora.trainable(self.model), cfg.optim, cfg.trainer.steps))
        self.ref_model: torch.nn.Module | None = None  # loss.kl_coef > 0: the KL reference
        self.whole_refs: dict[str, torch.nn.Module] = {}  # whole-model policies': theirs
        self.frozen_model: torch.nn.Module | None = None  # roles.serve "frozen": never updated
        # The engine's weights: the policy's own (shared), or a copy one version behind while the
        # update runs (collect overlap; continuous collection ahead of a local engine), or a server's.
        ahead = cfg.trainer.collect == "continuous" and cfg.trainer.max_staleness > 0
        self.sync = WeightSync(self.model, sleep_level=getattr(cfg.engine, "sleep_level", 0), own_copy=(
            cfg.trainer.collect == "overlap" or (ahead and cfg.engine.kind == "local")))
        # where the run is (what a checkpoint saves and a resumed run restores, run/checkpoint.py)
        self.step = 0
        self.version = 0  # the policy's model version: one bump per update step
        self.history: list[dict] = []
        self.next_collected: Collected | None = None  # step `step`'s rollouts, collected before the checkpoint
        self.collector_state: dict | None = None  # collect "continuous": what it had launched
        self.resumed_precision: str | None = None  # what "auto" chose
        self.step_rng: dict | None = None  # the random state at the end of the last step
        self.eval_pending = False  # a signal stopped the last step's eval: run it on resume
        # the services of `run` (None outside it)
        self.agent = None  # the task source's agent (resolved when the run starts)
        self.nonce = secrets.token_hex(3)  # names this process's rollouts apart from a resumed run's
        self.store = None
        self.http_client = None
        self.workers: AgentWorkers | None = None
        self.collector = None  # collect "continuous": the groups in flight (continuous.Collector)
        self.lockstep = Lockstep() if cfg.lockstep else None  # trainer.reproducible
        self.update_executor: ThreadPoolExecutor | None = None  # an own update thread: see on_update_thread
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.started = time.perf_counter()  # time/elapsed_s counts from `run`'s start
        self.checkpoints = checkpoint.Checkpoints(self.run_dir, cfg.trainer.keep_checkpoints)
        self.checkpointed = time.monotonic()  # when the last checkpoint was written
        self.stop = Stop(cfg.trainer.stop_grace_s, self.log)  # SIGTERM / SIGINT (run/stop.py)
        self.cancelled_at_end = 0  # rollouts still running when the collection ended

    # -- the run, top down -----------------------------------------------------------------
    async def run(self) -> list[dict]:
        """Resume or warm-start, then every step with the services up; a checkpoint at the end
        (or, stopped by a signal, of the last completed step: run/stop.py)."""
        self.stop.install(asyncio.get_running_loop())
        try:  # (the event loop's thread has no OpenMP team: models/compute.py)
            with contextlib.suppress(Stopped), one_thread_here():
                await self.run_all()
        finally:
            self.stop.uninstall()
            self.checkpoints.close()
        if self.stop.requested.is_set():
            saved = (f"checkpoint of step {self.step} written to {self.run_dir / 'checkpoint.pt'}"
                     if self.step_rng is not None else "stopped before the first step: nothing saved")
            self.log(f"stopped: {saved}; trainer.resume=true continues the run")
        return self.history

    async def run_all(self) -> None:
        cfg = self.cfg
        # refused before any work: a gateway off loopback without an admin key, top_p the engine
        # cannot honour, the engine's interpreter, GPU-only engine keys
        admin_key = admin_key_for(cfg.gateway.host) if self.dp.is_main else None
        check_top_p(cfg)
        preflight(cfg)
        self.agent = resolve_agent(self.task, cfg.agent)
        self.started = time.perf_counter()
        resumed = cfg.trainer.resume and self.load_checkpoint()
        if cfg.trainer.precision == "auto":
            cfg = self.cfg = await resolve_precision(self)
        if self.dp.is_main:
            claim_run_dir(self.run_dir, cfg, self.history if resumed else None)
        if not resumed and cfg.warm_start.steps and self.dp.is_main:
            await self.warm_start()
            policies.copy_base(cfg, self.model, self.whole)  # the warm-started backbone
        # DDP copies rank 0's (warm-started) weights
        self.policy = (wrap(self.model, self.dp) if cfg.policies is None else
                       wrap_policies(self.model, list(cfg.adapter_policies), self.dp, self.whole))
        self.start_reference()
        if not self.dp.is_main:
            await self.on_update_thread(self.update_threads, self.follow)
            return
        async with services.started(self, admin_key) as (gateway, engine):
            from tqdm import tqdm

            bar = tqdm(total=cfg.trainer.steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True)
            try:
                with (contextlib.suppress(Stopped),  # (a stop saves the last completed step too)
                      open_trackers(cfg, self.run_dir, self.log) as self.trackers):
                    await self.run_steps(gateway, engine, bar)
            finally:
                bar.close()
            if self.dp.enabled and self.step < cfg.trainer.steps:  # stopped: the other ranks too
                await self.on_update_thread(0, from_main, STOPPED, self.dp)
            self.save_checkpoint(self.next_collected, final=True)  # before the services stop: a slow server's end must not cost it
            self.stop.saved = True

    async def run_steps(self, gateway: GatewayClient, engine, bar) -> None:
        """The steps of the run. collect "overlap": step k+1's rollouts are collected while step k's
        update runs, by the policy before that update (one version behind); the engine takes the
        new weights between the two collects, so each step's rollouts come from one version.
        collect "continuous": each step takes finished groups from those in flight (continuous.py)."""
        cfg, overlap, stop = self.cfg, self.cfg.trainer.collect == "overlap", self.stop
        pending: asyncio.Task | None = None  # collect overlap: the next step's collect
        collected: Collected | None = None
        self.step_rng = checkpoint.rng_state()  # (a resumed run's: its checkpoint's, just restored)
        await end_unfinished(self.store, None, self.log)  # what a killed process left running
        if self.eval_pending:
            await stop.until(self.eval_again(gateway, engine))
        initial = await stop.until(self.evaluate(gateway)) if cfg.trainer.eval_every and self.step == 0 else None
        if cfg.trainer.collect == "continuous":
            self.collector = continuous.start(self, gateway, engine)
        clock = EngineClock(self.sync.slot, engine)
        try:
            while self.step < cfg.trainer.steps:
                collected = await stop.until(self.next_rollouts(gateway, engine, pending, clock))
                pending = None
                if overlap:
                    await self.sync.catch_up(gateway, self.version)
                    if self.step + 1 < cfg.trainer.steps:
                        pending = asyncio.create_task(self.collect_step(gateway, engine, self.step + 1))
                try:
                    m = await self.learn(gateway, engine, collected)
                except UpdateStopped:
                    raise Stopped from None
                if self.collector is not None:
                    self.collector.trained()  # (after the engine took the new weights)
                m["engine/idle_frac"] = clock.idle_since_last()
                if initial is not None:
                    m["eval/initial_reward_mean"], initial = initial, None
                try:
                    if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
                        m["eval/reward_mean"] = await stop.until(self.eval_after_update(gateway, pending))
                except Stopped:  # the step is done but for its eval: a resumed run runs it
                    self.eval_pending = True
                    raise
                finally:
                    m["time/elapsed_s"] = time.perf_counter() - self.started
                    self.record(m, bar)
                if checkpoint.due(cfg.trainer, self.step, self.checkpointed):
                    self.save_checkpoint(await stop.until(pending) if pending is not None else None)
        finally:  # the collection ends: what is still running is cancelled, its rollouts failed
            if overlap and self.next_collected is None:  # stopped: this step's rollouts, if collected
                self.next_collected = collected_of(self.step, collected, pending)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await continuous.stop(self)
            self.cancelled_at_end = await end_unfinished(self.store, self.nonce, self.log)

    async def next_rollouts(self, gateway: GatewayClient, engine, pending: asyncio.Task | None,
                            clock: EngineClock) -> Collected:
        """Step `step`'s rollouts: taken from the continuous collection, or the overlapped collect
        already running, or the checkpoint's (collected before it), or collected now."""
        resumed, self.next_collected = self.next_collected, None
        if self.collector is not None:
            return await continuous.take_step(self.collector, engine, self.step, self.version, clock.stats)
        if pending is not None:
            return await pending
        if resumed is not None and resumed.step == self.step:
            return resumed
        return await self.collect_step(gateway, engine, self.step)

    async def learn(self, gateway: GatewayClient, engine, collected: Collected) -> dict:
        """Rows -> advantages -> PPO update -> version bump, for the rollouts of one step."""
        cfg = self.cfg
        self.sync.check_engine()
        results = collected.results
        batch, adv, row_metrics = build_rows(self.store, results, cfg, self.tokenizer, self.version)
        metrics: dict[str, Any] = {"step": self.step, **row_metrics, **collected.metrics}
        if cfg.policies is not None:  # several policies: each its own rows (run/policies.py)
            parts = policies.build_policy_rows(self.store, results, cfg, self.tokenizer, self.version)
            metrics.update(policies.row_metrics(parts))
        # The engine's work in this step's collect: decode loops, forward passes, prompt tokens.
        metrics.update(engine_metrics(collected.engine_work))
        t1 = time.perf_counter()
        if self.dp.enabled:  # every rank trains on rank 0's rows (or skips the step with it)
            work = (batch, adv) if cfg.policies is None else parts
            await self.on_update_thread(0, from_main, work if batch.n_rows else None, self.dp)
        if batch.n_rows:
            common = {"measure_gap": collected.engine_version == self.version,
                      "stop": self.stop.requested.is_set}
            work = (functools.partial(policies.update, self.policy, parts, self.optimizer, self.scheduler,
                                      cfg, refs=self.policy_refs(), dp=self.dp, **common)
                    if cfg.policies is not None else
                    functools.partial(ppo_update, self.policy, self.optimizer, batch, adv, cfg,
                                      ref_model=self.ref_model, scheduler=self.scheduler, dp=self.dp, **common))
            updates, times = await self.sync.update(
                gateway, lambda: self.on_update_thread(self.update_threads, work),
                self.version + 1, push_now=cfg.trainer.collect != "overlap")
            self.version += 1
            metrics.update(times)
            metrics.update(update_metrics(updates) if cfg.policies is None else
                           policies.policy_update_metrics(updates, self.scheduler))
        metrics["model_version"] = self.version
        metrics["rollout_model_version"] = collected.engine_version
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics.update(throughput(len(results), batch, collected.seconds, time.perf_counter() - t1))
        metrics["memory/peak_rss_gb"] = peak_rss_gb()  # since the last step's line
        reset_peak()
        self.step += 1
        return metrics

    async def eval_after_update(self, gateway: GatewayClient, pending: asyncio.Task | None) -> float:
        """The eval pass after this step's update: the engine takes the new weights first (an
        overlapped collect of the next step finishes on the old ones before)."""
        if pending is not None:
            await asyncio.wait([pending])
        elif self.cfg.trainer.collect == "overlap" and self.step >= self.cfg.trainer.steps:
            self.sync.keep_for_resume()  # the last step: keep what a longer resumed run collects with
        await self.sync.catch_up(gateway, self.version)
        return await self.evaluate(gateway)

    async def eval_again(self, gateway: GatewayClient, engine) -> None:
        """The eval a signal stopped (the last step's), into its metrics line, as the uninterrupted
        run ran it: collect overlap, after the next step's collect (when the checkpoint has not
        its rollouts: from the engine's weights, kept for it). Continuous collection with an own
        copy of the weights leaves it out (the engine holds the weights of the groups in flight)."""
        overlap = self.cfg.trainer.collect == "overlap"
        if self.sync.own_copy and not overlap:
            self.eval_pending = False
            self.log(f"step {self.step - 1}'s eval was stopped by a signal; not run again (the engine "
                     "holds the weights of the next step's rollouts)")
            return
        if overlap and self.next_collected is None and self.step < self.cfg.trainer.steps:
            self.next_collected = await self.collect_step(gateway, engine, self.step)
        self.history[-1]["eval/reward_mean"] = await (self.eval_after_update(gateway, None) if overlap
                                                      else self.evaluate(gateway))
        self.eval_pending = False
        rewrite_metrics(self.run_dir, self.history)

    def record(self, m: dict, bar) -> None:
        """A step's metrics: history, metrics.jsonl, the trackers, the progress bar and its line;
        the random state of the step's end (what a checkpoint of it keeps)."""
        self.history.append(m)
        self.step_rng = checkpoint.rng_state()
        try:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(m) + "\n")
        except OSError as e:
            raise OSError(e.errno, f"{self.metrics_path}: {e.strerror or e}") from e
        self.trackers.log(m)
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}", rps=f"{m['rollouts_per_s']:.0f}")
        bar.write(format_step(m))

    def follow(self) -> None:
        """A rank other than 0: take each step's rows from rank 0 and join its update."""
        while self.step < self.cfg.trainer.steps:
            work = from_main(None, self.dp)
            if work == STOPPED:  # rank 0 was stopped (run/stop.py): so is this rank
                return
            if work is not None and self.cfg.policies is not None:  # {policy: its rows}
                policies.update(self.policy, work, self.optimizer, self.scheduler, self.cfg,
                                refs=self.policy_refs(), measure_gap=False, dp=self.dp)
            elif work is not None:
                batch, adv = work
                ppo_update(self.policy, self.optimizer, batch, adv, self.cfg,
                           ref_model=self.ref_model, scheduler=self.scheduler, dp=self.dp)
            self.step += 1

    # -- collecting ------------------------------------------------------------------------
    async def collect(self, gateway: GatewayClient, tasks: list[dict], prefix: str, n_per_task: int,
                      temperature: float, step: int | None = None) -> list[RolloutResult]:
        return await collect(gateway, rollout_specs(tasks, n_per_task, prefix), self.agent, self.cfg,
                             temperature=temperature, step=self.step if step is None else step,
                             http_client=self.http_client, workers=self.workers, lockstep=self.lockstep)

    async def collect_step(self, gateway: GatewayClient, engine, step: int) -> Collected:
        """The rollouts of step `step` (its tasks, n per task), with the engine's work and time."""
        cfg = self.cfg
        t0 = time.perf_counter()
        work = [k for k in ENGINE_WORK if k in engine.stats]
        before, version = {k: engine.stats[k] for k in work}, engine.model_version
        results = await self.collect(gateway, step_tasks(self.task, cfg, step, self.data), f"{self.nonce}-s{step}",
                                     cfg.rollout.n_per_task, cfg.rollout.temperature, step)
        return Collected(step, results, time.perf_counter() - t0,
                         {k: engine.stats[k] - before[k] for k in work}, version)

    async def train_step(self, gateway: GatewayClient, engine) -> dict:
        """Collect this step's rollouts, then learn from them."""
        return await self.learn(gateway, engine, await self.collect_step(gateway, engine, self.step))

    async def evaluate(self, gateway: GatewayClient) -> float:
        """Mean reward of one greedy rollout on each of `eval_tasks` tasks (not trained on)."""
        tasks = eval_tasks(self.cfg, self.task, self.data, self.cfg.trainer.eval_tasks)
        results = await self.collect(gateway, tasks, f"{self.nonce}-eval{self.step}", 1, 0.0)
        self.sync.drop_prefix_caches()  # the next collect starts as a resumed run's would
        self.trackers.samples(self.step - 1, eval_samples(self.store, self.tokenizer, tasks, results))
        rewards = [r.reward for r in results if r.state == "succeeded" and r.reward is not None]
        return sum(rewards) / len(rewards) if rewards else float("nan")

    # -- before the steps ------------------------------------------------------------------
    def start_reference(self) -> None:
        """loss.kl_coef > 0 (or a policy's): the KL reference, checkpoint.frozen_copy of the policy
        (or restored)."""
        if policies.needs_reference(self.cfg) and self.ref_model is None:
            self.ref_model = checkpoint.frozen_copy(self.model)
        if not self.whole_refs:
            self.whole_refs = policies.references(self.cfg, self.whole)

    def policy_refs(self) -> dict[str, torch.nn.Module | None]:
        """Several policies: each one's KL reference (an adapter's: the base's copy)."""
        return {**dict.fromkeys(self.cfg.adapter_policies, self.ref_model), **self.whole_refs}

    async def warm_start(self) -> None:
        """warm_start.steps supervised steps on the task module's transcripts (learn/warmstart.py)."""
        from tracetrain.learn.warmstart import warm_start

        cfg, ws, t = self.cfg, self.cfg.warm_start, time.perf_counter()
        make = getattr(self.task, ws.transcripts, None)
        if not callable(make):
            raise ConfigError(f"config key 'warm_start.transcripts': the task module has no function {ws.transcripts!r}")
        transcripts = make(ws.steps * ws.batch_size, seed=cfg.trainer.seed, **cfg.task_args)
        # several policies: the base they share is warm-started, not an adapter
        with lora.base_trainable(self.model) if cfg.adapter_policies else contextlib.nullcontext():
            losses = await self.on_update_thread(  # nothing else runs yet: the update's threads
                max(self.threads, self.update_threads), warm_start, self.model, self.tokenizer,
                transcripts, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=cfg.trainer.seed,
                precision=cfg.trainer.precision)
        self.log(f"warm start: {ws.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                 f"in {time.perf_counter() - t:.1f} s")

    async def on_update_thread(self, threads: int, fn, /, *args, **kwargs):
        """fn(*args, **kwargs) with `threads` torch threads on the compute thread, where the local
        engine decodes (the update takes turns with the collection: one OpenMP team); with
        `trainer.collect` overlap or continuous, which decode during the update, on an own thread."""
        executor = compute_thread() if self.cfg.trainer.collect == "step" else self.update_executor
        if executor is None:
            executor = self.update_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update")
        return await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(run_with_threads, threads, fn, *args, **kwargs))

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, next_collected: Collected | None = None, *, final: bool = False) -> None:
        """The run's state into run_dir/checkpoints (checkpoint.Checkpoints): copied, and written
        while the run goes on; `final` (the run's end): written before this returns, and
        run_dir/policy too."""
        self.checkpoints.write(checkpoint.state(self, next_collected, copied=not final), wait=final)
        self.checkpointed = time.monotonic()
        if final:
            checkpoint.write_policy(self.model, self.tokenizer, self.run_dir / "policy", self.whole)

    def load_checkpoint(self) -> bool:
        """The newest checkpoint that verifies into this trainer (checkpoint.resume); False if none."""
        return checkpoint.resume(self)
