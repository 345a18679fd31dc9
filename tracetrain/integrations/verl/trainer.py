"""`tracetrain train --backend verl CONFIG`: verl's workers train and serve, tracetrain collects.

    verl (Ray)                                     tracetrain (this process)
    RayPPOTrainer.init_workers: FSDP actor (+ref),  gateway on 127.0.0.1 with one `upstream` engine
    vLLM/SGLang rollout servers (one per replica)   per rollout server; store (SQLite); runner
                                                    runs the agents, a group on one replica
    per step:
      checkpoint_manager.update_weights(step)  ->  engines resume at model_version = step
                                               <-  agents run; turns recorded (token ids, logprobs)
      checkpoint_manager.sleep_replicas()      <-  engines paused and drained
                                                   store -> aggregate -> advantages -> DataProto
      actor.update_actor (verl's mini-batch loop,  <-  (dataproto.py lays the rows out; loss.py
      micro-batches, FSDP, optimizer)                  is the loss)

Weights reach the rollout servers through verl's own CheckpointEngineManager; the loop is
tracetrain's (RayPPOTrainer.fit is not used: its rollout source is verl's agent loop), the
workers, servers and weight sync are verl 0.9.1's, built as verl's main_ppo_v0 TaskRunner does.
Only runs on GPU machines with vLLM or SGLang; tests/integrations/test_verl_config.py checks, on CPU, the verl
config and worker layout it builds; tests/integrations/test_verl_loss.py the actor update it calls.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from functools import partial
from pathlib import Path
from typing import Any

from tracetrain.integrations.verl.config import VerlConfig, build_verl_config
from tracetrain.run.failures import FailedSteps, failed_step_line
from tracetrain.types import RunFailed


def update_actor(
    actor_wg: Any, proto: Any, *, epochs: int = 1, calculate_entropy: bool = False
) -> dict:
    """One step's optimizer updates on verl's actor (what RayPPOTrainer._update_actor does in
    verl 0.9.1), with the mini-batch size `to_dataproto` laid the rows out for and no shuffling:
    verl's mini-batch k is tracetrain's mini-batch k. Returns verl's metrics."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    rows = int(proto.meta_info["mini_batch_size"])
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=rows,
        mini_batch_size=rows,
        epochs=epochs,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    out = actor_wg.update_actor(td)
    return tu.get(out, "metrics")


def verl_workers(conf: Any) -> tuple[dict, Any]:
    """(role -> Ray worker class, resource pool manager) for `conf`, as verl's TaskRunner builds
    them (verl's checks of the config included). Starts nothing."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    runner = BaseTaskRunner()
    runner.add_actor_rollout_worker(conf)
    runner.add_critic_worker(conf)
    runner.add_reward_model_resource_pool(conf)
    validate_config(
        config=conf, use_reference_policy=need_reference_policy(conf), use_critic=need_critic(conf)
    )
    return runner.role_worker_mapping, runner.init_resource_pool_mgr(conf)


def served_model(address: str, default: str) -> str:
    """The model name an OpenAI-compatible server at host:port serves (GET /v1/models)."""
    import httpx

    try:
        data = httpx.get(f"http://{address}/v1/models", timeout=10.0).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return default


def _as_list(items: list) -> list:
    return items


def make_trainer(conf: Any, n_tasks: int):
    """verl's RayPPOTrainer for `conf`, workers not started (`init_workers` starts them). Its
    dataloader is a placeholder of n_tasks items: tasks come from the tracetrain task module."""
    from torch.utils.data import SequentialSampler
    from verl.single_controller.ray import RayWorkerGroup
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.config import omega_conf_to_dataclass

    mapping, pools = verl_workers(conf)
    model = omega_conf_to_dataclass(conf.actor_rollout_ref.model)
    tasks = list(range(n_tasks))
    return RayPPOTrainer(
        config=conf,
        tokenizer=model.tokenizer,
        processor=model.processor,
        role_worker_mapping=mapping,
        resource_pool_manager=pools,
        ray_worker_group_cls=RayWorkerGroup,
        train_dataset=tasks,
        val_dataset=tasks,
        collate_fn=_as_list,
        train_sampler=SequentialSampler(tasks),
    )


class VerlRun:
    """One run: verl's RayPPOTrainer (workers, servers, weight sync) + tracetrain's gateway."""

    def __init__(self, cfg: Any, conf: Any, task: Any, *, data: Any = None, log=print):
        from verl.utils.config import omega_conf_to_dataclass

        from tracetrain.integrations.verl.loss import ppo_loss

        self.cfg, self.conf, self.task, self.log = cfg, conf, task, log
        self.data = data  # the run's dataset (dataset.TaskData), when data.train names one
        self.run_dir = Path(cfg.trainer.run_dir)
        self.trainer = make_trainer(conf, cfg.rollout.tasks_per_step)
        self.tokenizer = self.trainer.tokenizer
        self.trainer.init_workers()
        lc = cfg.loss
        if lc.kl_coef > 0 or lc.entropy_coef > 0:  # verl's ppo_loss would not weight these terms
            actor_config = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
            self.trainer.actor_rollout_wg.set_loss_fn(partial(ppo_loss, config=actor_config))
        self.dp_size = self.trainer._get_dp_size(self.trainer.actor_rollout_wg, "actor")
        self.addresses = list(self.trainer.llm_server_manager.server_addresses)
        self.step = 0
        self.failures = FailedSteps(cfg.trainer.max_failed_steps)  # (run/failures.py)
        self.failed: str | None = None  # why the run stopped, when its rollouts failed

    def engines(self) -> dict[str, Any]:
        from tracetrain.engines.upstream import UpstreamEngine

        ac, v = self.cfg.aggregate, self.conf.actor_rollout_ref
        path = v.model.path
        return {
            f"verl-{k}": UpstreamEngine(
                f"http://{addr}",
                served_model(addr, path),
                self.tokenizer,
                name=f"verl-{k}",
                max_context=ac.max_prompt_length + ac.max_response_length,
                api=v.rollout.name if v.rollout.name == "sglang" else "vllm",
            )
            for k, addr in enumerate(self.addresses)
        }

    async def train_step(self, gateway, engines: dict, http) -> dict:
        """The shared step (tracetrain/run/step.py) on verl: the servers take the weights, collect,
        rows, verl's actor learns."""
        from tracetrain.run.step import build_rows, collect, rollout_specs, step_tasks, throughput

        cfg, rc, t0 = self.cfg, self.cfg.rollout, time.perf_counter()
        cm = self.trainer.checkpoint_manager
        await asyncio.to_thread(cm.update_weights, self.step)  # sync: wakes the servers, new weights
        for name, engine in engines.items():
            engine.model_version = self.step
            await gateway.engine(name, "resume")
        tasks = step_tasks(self.task, cfg, self.step, self.data)
        specs = rollout_specs(tasks, rc.n_per_task, f"{self.nonce}-s{self.step}", list(engines))
        results = await collect(gateway, specs, self.agent, cfg, temperature=rc.temperature,
                                step=self.step, http_client=http)
        for name in engines:
            await gateway.drain(name)  # holds new requests, waits for those in flight
        await asyncio.to_thread(cm.sleep_replicas)  # free the servers' GPU memory for training
        t_collect = time.perf_counter() - t0
        if reason := self.failures.see(self.step, results):  # not trained, nor checkpointed
            self.log(failed_step_line(self.step, results, reason))
            raise RunFailed(reason)

        batch, adv, row_metrics = build_rows(self.store, results, cfg, self.tokenizer, self.step)
        m: dict[str, Any] = {"step": self.step, **row_metrics}
        t1 = time.perf_counter()
        if batch.n_rows:
            m.update(await asyncio.to_thread(self.update, batch, adv))
        t_train = time.perf_counter() - t1
        self.step += 1
        m["model_version"] = self.step
        m.update(throughput(len(results), batch, t_collect, t_train))
        return m

    def update(self, batch, adv) -> dict:
        """DataProto (ref logprobs from verl's ref worker if KL is on) -> verl's actor update."""
        import torch

        from tracetrain.integrations.verl.dataproto import to_dataproto

        cfg, lc = self.cfg, self.cfg.loss
        old = batch.rollout_logprobs
        proto = to_dataproto(
            batch,
            adv,
            mode=lc.mode,
            norm_length=lc.norm_length,
            n_mini_batches=cfg.optim.mini_batches,
            dp_size=self.dp_size,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            temperature=cfg.rollout.temperature,
            old_log_probs=old if old is not None else torch.zeros(batch.response_mask.shape),
        )
        if old is None:  # the engine gave no logprobs: the actor's, before this step's updates
            recomputed, _ = self.trainer._compute_old_log_prob(proto)
            proto.batch["old_log_probs"] = recomputed.batch["old_log_probs"]
        if lc.kl_coef > 0:
            proto = proto.union(self.trainer._compute_ref_log_prob(proto))
        metrics = update_actor(
            self.trainer.actor_rollout_wg,
            proto,
            epochs=cfg.optim.ppo_epochs,
            calculate_entropy=lc.entropy_coef > 0,
        )
        out = {}
        for k, v in metrics.items():
            values = v if isinstance(v, list) else [v]
            nums = [
                float(x) for x in values if isinstance(x, (int, float)) or hasattr(x, "__float__")
            ]
            if nums:
                out[f"verl/{k}"] = sum(nums) / len(nums)
        out["loss"] = out.get("verl/actor/pg_loss", float("nan"))
        out["grad_norm"] = out.get("verl/grad_norm", float("nan"))
        return out

    async def run(self) -> list[dict]:
        from tracetrain.agents.runner import GatewayClient, agent_http_client
        from tracetrain.agents.tasks import resolve_agent
        from tracetrain.gateway.app import create_app
        from tracetrain.gateway.inprocess import admin_key_for, app_options, bind, serve_in_loop
        from tracetrain.run.rundir import format_step
        from tracetrain.run.trackers import start_trackers
        from tracetrain.store import SQLiteStore

        cfg = self.cfg
        self.nonce = secrets.token_hex(3)
        self.agent = resolve_agent(self.task, cfg.agent)
        self.store = SQLiteStore(self.run_dir / "traces.db")
        engines = self.engines()
        admin_key = admin_key_for(cfg.gateway.host)
        sock = bind(cfg.gateway)
        app = create_app(self.store, engines, admin_key=admin_key, close_engines=True,
                         **app_options(cfg.gateway, sock.getsockname()[1]))
        history, trackers = [], start_trackers(cfg, self.run_dir, self.log)
        try:
            async with (
                serve_in_loop(app, sock) as url,
                agent_http_client(cfg.rollout.concurrency) as http,
            ):
                gateway = GatewayClient(url, admin_key)
                try:
                    while self.step < cfg.trainer.steps:
                        try:
                            m = await self.train_step(gateway, engines, http)
                        except RunFailed as e:
                            self.failed = str(e)
                            break
                        history.append(m)
                        with (self.run_dir / "metrics.jsonl").open("a") as f:
                            f.write(json.dumps(m) + "\n")
                        trackers.log(m)
                        self.log(format_step(m))
                        every = cfg.trainer.checkpoint_every
                        if every and self.step % every == 0:
                            self.trainer.global_steps = self.step
                            await asyncio.to_thread(self.trainer._save_checkpoint)
                finally:
                    await gateway.aclose()
        finally:
            trackers.close()
            self.store.close()
        return history


def train_verl(
    cfg: Any, *, base_dir: Path | None = None, log=print, verl: VerlConfig | None = None
) -> dict:
    """Run the whole job on verl + Ray; writes metrics.jsonl, verl_config.yaml, summary.json.
    RunFailed when the run stopped because its rollouts failed (run/failures.py), after
    summary.json (its `stopped`: why) is written.

    `verl` defaults to `cfg.verl` (the config's `verl:` section) or VerlConfig()."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from tracetrain.agents.tasks import open_task_data
    from tracetrain.envs import load_source
    from tracetrain.run.report import summary
    from tracetrain.run.rundir import refuse_earlier_run
    from tracetrain.run.step import check_top_p

    check_top_p(cfg)  # before Ray or any worker starts (the collects check it again)
    v = verl or getattr(cfg, "verl", None) or VerlConfig()
    task = load_source(cfg, base_dir)
    data = open_task_data(cfg, base_dir, task)  # every row checked before Ray or any worker starts
    conf = build_verl_config(cfg, v)
    run_dir = Path(cfg.trainer.run_dir)
    refuse_earlier_run(run_dir, resumable=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    OmegaConf.save(conf, run_dir / "verl_config.yaml")
    if not ray.is_initialized():
        ray.init(address=v.ray_address, runtime_env=get_ppo_ray_runtime_env(conf))
    t = time.perf_counter()
    try:
        run = VerlRun(cfg, conf, task, data=data, log=log)
        history = asyncio.run(run.run())
    finally:
        if cfg.env is not None:  # what the environment opened in this process (a server)
            task.close()
    out = summary(history)
    out["wall_s"] = time.perf_counter() - t
    if run.failed is not None:  # (the step that stopped the run is in no history: counted here)
        out["stopped"] = run.failed
        out["failed_rollouts"] += run.failures.stop_counts.get("failed", 0)
        out["timed_out_rollouts"] += run.failures.stop_counts.get("timed_out", 0)
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    log("summary: " + ", ".join(f"{k} {val}" for k, val in out.items()))
    if run.failed is not None:
        raise RunFailed(run.failed)
    return out
