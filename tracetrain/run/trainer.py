"""The embedded trainer: one process, one machine, the whole loop (`Trainer.steps`).

    for step in 1..steps:
        collect     the collector's rollouts of the step (run/collectors.py: step, overlap,
                    continuous) -> turns in the store
        teacher     config `distill`: the teacher scores the rollouts' taught tokens (run/teacher.py)
        rows        the learner's rows and advantages (run/learner.py: one policy or several)
        update      PPO epochs over mini-batches of whole rollouts, on the update thread, while
                    the engine is held (shared weights) or keeps decoding (its own copy)
        sync        the model version goes up; the engine takes the new weights when its
                    collector says (after the update, or between two collects)
        eval        every trainer.eval_every steps: greedy rollouts on held-out tasks
        checkpoint  the run's state (run/state.py) with the weights (run/checkpoint.py)

The policy module is shared by the engine and the optimizer unless the engine keeps its own copy
(run/weights.py): collect overlap, continuous collection ahead of a local engine, a vLLM server
(engines/vllm.py; under LoRA the push is the adapter alone). Before the steps: resume or warm
start, trainer.precision "auto", the services (run/services.py); a signal stops the run at the
next stop point and saves its last completed step (run/stop.py); so does a step whose every
rollout failed, before it trains, and the run then raises RunFailed (run/failures.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from tracetrain.agents.lockstep import Lockstep
from tracetrain.agents.tasks import open_task_data, resolve_agent
from tracetrain.config import ConfigError, TrainConfig
from tracetrain.engines.start import preflight
from tracetrain.envs import load_source
from tracetrain.gateway.inprocess import admin_key_for
from tracetrain.learn.distributed import DataParallel, from_main
from tracetrain.models.compute import one_thread_here
from tracetrain.run import checkpoint, expert, services
from tracetrain.run.collectors import Play, StepCollector, collector_for
from tracetrain.run.evaluate import eval_samples, eval_tasks
from tracetrain.run.failures import FailedSteps, failed_step_line, first_error
from tracetrain.run.learner import load_learner
from tracetrain.run.memory import peak_rss_gb, release_free, reset_peak
from tracetrain.run.precision import resolve_precision
from tracetrain.run.rundir import claim_run_dir, format_step, rewrite_metrics
from tracetrain.run.state import RunState
from tracetrain.run.step import (
    Collected,
    EngineClock,
    check_top_p,
    end_unfinished,
    engine_metrics,
    throughput,
    tools_metrics,
)
from tracetrain.run.stop import Stop, Stopped
from tracetrain.run.teacher import close as close_teachers
from tracetrain.run.teacher import load_teachers, teach
from tracetrain.run.trackers import NO_TRACKERS, open_trackers
from tracetrain.run.update_thread import UpdateThread
from tracetrain.run.weights import WeightSync
from tracetrain.types import RunFailed

STOPPED = "stopped"  # what rank 0 sends the other ranks instead of a step's rows when it stopped


def prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` with `prefix` before each name."""
    return {prefix + k: v for k, v in metrics.items()}


def train(cfg: TrainConfig, *, base_dir: Path | None = None, log=print) -> dict:
    """Run the whole job; writes metrics.jsonl, checkpoint.pt, curve.png and summary.json.
    RunFailed when the run stopped because its rollouts failed (run/failures.py), after
    summary.json (its `stopped`: why) is written."""
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
            trainer.learner.unwrap()
        distributed.close(dp)
        if cfg.env is not None:  # what the environment opened in this process (a server)
            task.close()
    if not dp.is_main:
        return {}
    out = summary(history, target_gain=cfg.trainer.target_gain,
                  cancelled_at_end=trainer.cancelled_at_end)
    out["wall_s"] = time.perf_counter() - t
    if trainer.failed is not None:  # (the step that stopped the run is in no history: counted here)
        out["stopped"] = trainer.failed
        out["failed_rollouts"] += trainer.failures.stop_counts.get("failed", 0)
        out["timed_out_rollouts"] += trainer.failures.stop_counts.get("timed_out", 0)
    task_file = getattr(task, "__file__", None) if cfg.task.endswith(".py") else None
    name = Path(task_file).resolve().parent.name if task_file else cfg.task
    out["curve"] = str(plot_curves(history, trainer.run_dir / "curve.png",
                                   title=f"{name}: {cfg.agent} ({cfg.trainer.run_dir})"))
    (trainer.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    log("summary: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in out.items()))
    if trainer.failed is not None:
        raise RunFailed(trainer.failed)
    return out


class Trainer:
    """One run: its learner (the policy's weights and updates), the engine's weights (`sync`),
    its state (`state`: what a checkpoint keeps) and, while `run` runs, its services."""

    trackers = NO_TRACKERS  # trainer.report_to's, while `run` runs (run/trackers.py)

    def __init__(self, cfg: TrainConfig, task_module: Any, data=None, *, log=print,
                 dp: DataParallel = DataParallel()):
        self.cfg, self.task, self.data, self.dp = cfg, task_module, data, dp
        self.log = log if dp.is_main else (lambda *a, **k: None)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.engine.threads:
            torch.set_num_threads(cfg.engine.threads)
        # torch threads where the model runs (per OS thread: models/compute.py): the engine's
        # decoding, the update's (trainer.update_threads), the larger for the load and warm start
        threads = cfg.engine.threads or torch.get_num_threads()
        self.update_thread = UpdateThread(cfg.trainer.collect, threads,
                                          cfg.trainer.update_threads or threads)
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        self.learner = load_learner(cfg, max(threads, self.update_thread.update_threads), dp)
        # the engine's weights: the policy's own (shared), or a copy one version behind while
        # the update runs (collect overlap; continuous collection ahead of a local engine), or a
        # server's
        ahead = cfg.trainer.collect == "continuous" and cfg.trainer.max_staleness > 0
        own_copy = cfg.trainer.collect == "overlap" or (ahead and cfg.engine.kind == "local")
        self.sync = WeightSync(self.learner.model, own_copy=own_copy,
                               sleep_level=getattr(cfg.engine, "sleep_level", 0))
        self.state = RunState()
        self.nonce = secrets.token_hex(3)  # this process's rollouts apart from a resumed run's
        self.lockstep = Lockstep() if cfg.reproducible else None  # (agents/lockstep.py)
        self.started = time.perf_counter()  # time/elapsed_s counts from `run`'s start
        self.checkpoints = checkpoint.Checkpoints(self.run_dir, cfg.trainer.keep_checkpoints)
        self.checkpointed = time.monotonic()  # when the last checkpoint was written
        self.stop = Stop(cfg.trainer.stop_grace_s, self.log)  # SIGTERM / SIGINT (run/stop.py)
        self.cancelled_at_end = 0  # rollouts still running when the collection ended
        self.failures = FailedSteps(cfg.trainer.max_failed_steps)  # (run/failures.py)
        self.failed: str | None = None  # why the run stopped, when its rollouts failed
        self.saved_step = 0  # the step of the last checkpoint written (or resumed from)
        self.teachers: dict = {}  # config `distill`: {policy or None: its teacher (run/teacher.py)}

    async def run(self) -> list[dict]:
        """Resume or warm-start, then every step with the services up; a checkpoint at the end
        (or, stopped by a signal, of the last completed step: run/stop.py)."""
        self.stop.install(asyncio.get_running_loop())
        try:  # (the event loop's thread has no OpenMP team: models/compute.py)
            with contextlib.suppress(Stopped), one_thread_here():
                await self.run_all()
        finally:
            self.stop.uninstall()
            await close_teachers(self.teachers)
            self.checkpoints.close()
            self.update_thread.close()
        if self.stop.requested.is_set():
            saved = (f"checkpoint of step {self.state.step} written to "
                     f"{self.run_dir / 'checkpoint.pt'}" if self.state.rng is not None
                     else "stopped before the first step: nothing saved")
            self.log(f"stopped: {saved}; trainer.resume=true continues the run")
        return self.state.history

    async def run_all(self) -> None:
        """What comes before the steps, then the steps with the services up (rank 0), or rank 0's
        updates joined (the other ranks)."""
        cfg = self.cfg
        # refused before any work: a gateway off loopback without an admin key, top_p the engine
        # cannot honour, the engine's interpreter, GPU-only engine keys
        admin_key = admin_key_for(cfg.gateway.host) if self.dp.is_main else None
        check_top_p(cfg)
        preflight(cfg)
        if self.dp.is_main:  # (its tokenizer checked against the policy's before any work)
            self.teachers = await load_teachers(cfg, self.learner.tokenizer,
                                                self.update_thread.threads)
        agent = resolve_agent(self.task, cfg.agent)
        self.started = time.perf_counter()
        resumed = cfg.trainer.resume and self.load_checkpoint()
        if cfg.trainer.precision == "auto":
            cfg = self.cfg = await resolve_precision(
                cfg, self.learner.model, resumed=self.state.precision, dp=self.dp,
                update_thread=self.update_thread, log=self.log)
            self.learner.reconfigure(cfg)
        self.state.precision = cfg.trainer.precision
        if self.dp.is_main:
            claim_run_dir(self.run_dir, cfg, self.state.history if resumed else None)
        if not resumed and cfg.warm_start.steps and self.dp.is_main:
            if cfg.warm_start.expert is not None:  # demonstrations first (run/expert.py)
                await expert.warm_start(self.learner, cfg, self.task, self.data, agent,
                                        run_dir=self.run_dir, admin_key=admin_key or "",
                                        nonce=self.nonce, update_thread=self.update_thread,
                                        log=self.log)
            else:
                await self.learner.warm_start(self.task, self.update_thread, self.log)
            release_free()  # what the phase freed, not counted in the steps' peak memory
        self.learner.wrap()  # DDP copies rank 0's (warm-started) weights
        self.learner.start_reference()
        if not self.dp.is_main:
            await self.update_thread.run(self.update_thread.update_threads, self.follow)
            return
        async with services.started(
                cfg, self.learner, self.sync, version=self.state.version, task=self.task,
                run_dir=self.run_dir, threads=self.update_thread.threads, lockstep=self.lockstep,
                admin_key=admin_key, log=self.log) as svc:
            from tqdm import tqdm

            play = Play(cfg, self.task, self.data, agent, self.nonce, self.lockstep, svc)
            bar = tqdm(total=cfg.trainer.steps, initial=self.state.step, desc="train", unit="step",
                       dynamic_ncols=True)
            try:
                with (contextlib.suppress(Stopped),  # (a stop saves the last completed step too)
                      open_trackers(cfg, self.run_dir, self.log) as self.trackers):
                    await self.steps(play, bar)
            except RunFailed as e:  # (fail_fast) the failed step is not saved
                self.failed = str(e)
            finally:
                bar.close()
            if self.dp.enabled and self.state.step < cfg.trainer.steps:  # stopped: the others too
                await self.update_thread.run(0, from_main, STOPPED, self.dp)
            # before the services stop: a slow server's end must not cost it
            if self.failed is None or self.state.step > self.saved_step:  # the last completed step
                self.save_checkpoint(self.state, final=True)
            self.stop.saved = True

    async def steps(self, play: Play, bar) -> None:
        """The steps: collect -> rows -> update -> sync -> eval -> checkpoint. The collector says
        where a step's rollouts come from and when the engine takes the new weights
        (run/collectors.py); the learner makes the rows and updates the policies
        (run/learner.py); `state` is where the run is (run/state.py)."""
        cfg, st, stop, sync, learner = self.cfg, self.state, self.stop, self.sync, self.learner
        svc = play.services
        collector = collector_for(play, sync, stop, self.log)
        initial = await self.before_steps(play, collector)
        clock, collected = EngineClock(sync.slot, svc.engine), None
        try:
            while st.step < cfg.trainer.steps:
                collected = self.fail_fast(await stop.until(collector.take(st, clock)), bar)  # collect
                await collector.taken(st)
                sync.check_engine()  # (a vLLM server that died stops the run here)
                taught = await teach(self.teachers, svc.store, collected.results, cfg)  # teacher
                rows, work = learner.rows(svc.store, collected.results, st.version)  # rows
                m = {"step": st.step, **rows.metrics, **collected.metrics, **taught,
                     **engine_metrics(collected.engine_work)}
                t = time.perf_counter()
                if self.dp.enabled:  # every rank trains on rank 0's rows (or skips the step)
                    shared = work if rows.batch.n_rows else None
                    await self.update_thread.run(0, from_main, shared, self.dp)
                if rows.batch.n_rows:  # update
                    update = functools.partial(self.update_thread.update, learner.update, work,
                                               stop=stop.requested.is_set,
                                               measure_gap=collected.engine_version == st.version)
                    updates, times = await sync.run_update(svc.gateway, update, st.version + 1)
                    st.version += 1
                    m.update({**times, **learner.update_metrics(updates)})
                for k, v in (await collector.synced(st, updated=bool(rows.batch.n_rows))).items():
                    m[k] = m.get(k, 0.0) + v  # sync (an own copy's, after a shared whole model's)
                m.update({"model_version": st.version, "lr": learner.lr,
                          "rollout_model_version": collected.engine_version,
                          **throughput(len(collected.results), rows.batch, collected.seconds,
                                       time.perf_counter() - t),
                          "memory/peak_rss_gb": peak_rss_gb()})  # since the last step's line
                release_free()  # the C heap's free pages back: without it the peak grows each step
                reset_peak()
                st.step += 1
                m.update(clock.idle_shares(m.get("time/update_s", 0.0)))  # who waited for whom
                if initial is not None:
                    m.update(prefixed("eval/initial_", initial))
                    initial = None
                try:
                    if cfg.trainer.eval_every and st.step % cfg.trainer.eval_every == 0:  # eval
                        m.update(prefixed("eval/", await stop.until(
                            self.eval_after_update(play, collector))))
                except Stopped:  # the step is done but for its eval: a resumed run runs it
                    st.eval_pending = True
                    raise
                finally:
                    m["time/elapsed_s"] = time.perf_counter() - self.started
                    self.record(m, bar)
                if checkpoint.due(cfg.trainer, st.step, self.checkpointed):  # checkpoint
                    self.save_checkpoint(await collector.checkpoint(st))
        finally:  # the collection ends: what is still running is cancelled, its rollouts failed
            await collector.close(st, collected)
            self.cancelled_at_end = await end_unfinished(svc.store, self.nonce, self.log)

    def fail_fast(self, collected: Collected, bar) -> Collected:
        """`collected`, unless its step stops the run (failures.FailedSteps): then its step line
        and RunFailed (EngineError when the engine's server died); the step is neither trained nor
        kept for a resumed run."""
        reason = self.failures.see(collected.step, collected.results)
        if reason is None:
            return collected
        self.sync.check_engine()  # a vLLM server that died: its EngineError names the cause
        bar.write(failed_step_line(collected.step, collected.results, reason))
        raise RunFailed(reason)

    async def before_steps(self, play: Play, collector: StepCollector) -> dict | None:
        """What a killed process left running failed; the eval a signal stopped run again; the
        initial eval's metrics (returned), then the collector started."""
        st = self.state
        st.rng = checkpoint.rng_state()  # (a resumed run's: its checkpoint's, just restored)
        await end_unfinished(play.services.store, None, self.log)
        if st.eval_pending:
            await self.stop.until(self.eval_again(play, collector))
        initial = (await self.stop.until(self.evaluate(play))
                   if self.cfg.trainer.eval_every and st.step == 0 else None)
        collector.start(st)
        return initial

    async def evaluate(self, play: Play) -> dict[str, float]:
        """One greedy rollout on each of `eval_tasks` tasks (not trained on): `reward_mean`, their
        mean reward (nan when every one failed), and their tools/* metrics (step.tools_metrics;
        none when no tools were offered)."""
        tasks = eval_tasks(self.cfg, self.task, self.data, self.cfg.trainer.eval_tasks)
        step = self.state.step
        results = await play.rollouts(tasks, f"{self.nonce}-eval{step}", 1, 0.0, step)
        self.sync.drop_prefix_caches()  # the next collect starts as a resumed run's would
        samples = eval_samples(play.services.store, self.learner.tokenizer, tasks, results)
        self.trackers.samples(step - 1, samples)
        rewards = [r.reward for r in results if r.state == "succeeded" and r.reward is not None]
        if results and all(r.state != "succeeded" for r in results):
            self.log(f"eval pass before step {step}: every one of its {len(results)} rollouts failed "
                     f"(eval/reward_mean nan): {first_error(results)}")
        store = play.services.store
        tools = tools_metrics(store, store.load_rollouts(rollout_ids=[r.rollout_id for r in results]))
        return {"reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"), **tools}

    async def eval_after_update(self, play: Play, collector: StepCollector) -> dict[str, float]:
        """The eval pass after this step's update, once the engine took the new weights."""
        await collector.before_eval(self.state)
        return await self.evaluate(play)

    async def eval_again(self, play: Play, collector: StepCollector) -> None:
        """The eval a signal stopped (the last step's), into its metrics line, as the
        uninterrupted run ran it (collectors' before_eval_again)."""
        st = self.state
        if not collector.reruns_eval:
            st.eval_pending = False
            self.log(f"step {st.step - 1}'s eval was stopped by a signal; not run again (the "
                     "engine holds the weights of the next step's rollouts)")
            return
        await collector.before_eval_again(st)
        st.history[-1].update(prefixed("eval/", await self.eval_after_update(play, collector)))
        st.eval_pending = False
        rewrite_metrics(self.run_dir, st.history)

    def record(self, m: dict, bar) -> None:
        """A step's metrics: history, metrics.jsonl, the trackers, the progress bar and its line;
        the random state of the step's end (what a checkpoint of it keeps)."""
        self.state.history.append(m)
        self.state.rng = checkpoint.rng_state()
        path = self.run_dir / "metrics.jsonl"
        try:
            with path.open("a") as f:
                f.write(json.dumps(m) + "\n")
        except OSError as e:
            raise OSError(e.errno, f"{path}: {e.strerror or e}") from e
        self.trackers.log(m)
        bar.update(1)
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}", rps=f"{m['rollouts_per_s']:.0f}")
        bar.write(format_step(m))

    def follow(self) -> None:
        """A rank other than 0: take each step's rows from rank 0 and join its update."""
        while self.state.step < self.cfg.trainer.steps:
            work = from_main(None, self.dp)
            if work == STOPPED:  # rank 0 was stopped (run/stop.py): so is this rank
                return
            if work is not None:
                self.learner.update(work)
            self.state.step += 1

    def save_checkpoint(self, state: RunState, *, final: bool = False) -> None:
        """`state` with the weights into run_dir/checkpoints (checkpoint.Checkpoints): copied, and
        written while the run goes on; `final` (the run's end): written before this returns, and
        run_dir/policy too."""
        saved = checkpoint.state(state, self.learner, self.sync, copied=not final)
        self.checkpoints.write(saved, wait=final)
        self.checkpointed, self.saved_step = time.monotonic(), state.step
        if final:
            self.learner.write_policy(self.run_dir / "policy")

    def load_checkpoint(self) -> bool:
        """The newest checkpoint that verifies, restored (checkpoint.resume); False if none."""
        resumed = checkpoint.resume(self.run_dir, self.learner, self.sync, self.log)
        if resumed is not None:
            self.state, self.saved_step = resumed, resumed.step
        return resumed is not None
