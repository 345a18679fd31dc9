"""The services of a run, started in order and stopped in reverse: the trace store, the engine
(and roles.serve's, and each whole-model policy's), the agent workers, the in-process gateway,
the agents' HTTP client."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracetrain.agents.runner import GatewayClient, agent_http_client
from tracetrain.agents.workers import AgentRef, AgentWorkers
from tracetrain.config import TrainConfig
from tracetrain.engines.start import start_engine
from tracetrain.rows.roles import role_engines
from tracetrain.run import policies


@dataclass
class Services:
    """What a run's steps talk to while `started` holds them up."""

    gateway: GatewayClient  # the in-process gateway, as the agents and the trainer call it
    engine: Any  # the policy's engine
    store: Any  # the trace store (run_dir/traces.db)
    http_client: Any  # the agents' connections (agents in this process)
    workers: AgentWorkers | None  # rollout.agent_workers: the agents' processes


@contextlib.asynccontextmanager
async def started(cfg: TrainConfig, learner, sync, *, version: int, task, run_dir: Path,
                  threads: int, lockstep, admin_key: str | None, log=print):
    """The run's Services: the store, the engine on `sync.engine_weights(version)` (the policy
    of `learner`, run/learner.py, or the engine's own copy), roles.serve's "frozen" engine,
    whole-model policies' engines, the agent workers (of task source `task`), the gateway, the
    agents' HTTP client; stopped in reverse. The engine is attached to `sync` (run/weights.py)."""
    from tracetrain.gateway.app import create_app
    from tracetrain.gateway.inprocess import app_options, bind, serve_in_loop
    from tracetrain.store import SQLiteStore

    store, engines, workers = SQLiteStore(run_dir / "traces.db"), {}, None
    on = {"run_dir": run_dir, "threads": threads, "log": log, "lockstep": lockstep}
    try:
        weights, engine_version = sync.engine_weights(version)
        engines["default"] = engine = await start_engine(cfg, weights, learner.tokenizer,
                                                         version=engine_version, **on)
        if "frozen" in cfg.roles.serve.values():  # a copy of the policy, never updated
            engines["frozen"] = await start_engine(cfg, learner.frozen_policy(), learner.tokenizer,
                                                   version=0, **on)
        for name, model in learner.whole.items():  # whole-model policies: a local engine each
            engines[policies.engine_name(name)] = await start_engine(
                cfg, model, learner.tokenizer, version=version, **on)
        if cfg.rollout.agent_workers:  # agents in their own processes (agents/workers.py)
            workers = AgentWorkers(agent_ref(cfg, task), cfg.rollout.agent_workers,
                                   max_connections=cfg.rollout.concurrency)
        sock = bind(cfg.gateway)  # agents get gateway.public_url (gateway/inprocess.py)
        app = create_app(store, engines, admin_key=admin_key, default_engine="default",
                         **app_options(cfg.gateway, sock.getsockname()[1]))
        gw = app.state.gateway
        gw.role_engines.update(role_engines(cfg.roles.serve))
        policies.serve(gw, cfg, learner.whole)  # each call by its role's policy
        sync.attach(engine, gw.slots["default"])  # held in-process around updates
        for name in map(policies.engine_name, learner.whole):  # (a whole-model policy's too)
            sync.attach_whole(engines[name], gw.slots[name])
        async with (serve_in_loop(app, sock) as url,
                    agent_http_client(cfg.rollout.concurrency) as http):
            gateway = GatewayClient(url, admin_key)
            try:
                yield Services(gateway, engine, store, http, workers)
            finally:
                await gateway.aclose()
    finally:
        if workers is not None:
            workers.close()
        for e in engines.values():
            await e.aclose()
        store.close()


def agent_ref(cfg: TrainConfig, task) -> AgentRef:
    """How an agent worker process finds the agent: the task module's file or name, or the
    environment (pickled as its config section)."""
    task_spec = getattr(task, "__file__", None) if cfg.task.endswith(".py") else cfg.task
    env = task if cfg.env is not None else None
    return AgentRef(task_spec or cfg.task, None, cfg.agent, env)
