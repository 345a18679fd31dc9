"""The services of a run, started in order and stopped in reverse: the trace store, the engine
(and roles.serve's), the agent workers, the in-process gateway, the agents' HTTP client. Each
function takes the run's Trainer (run/trainer.py), whose fields it fills and reads."""

from __future__ import annotations

import contextlib

from tracetrain.agents.runner import GatewayClient, agent_http_client
from tracetrain.agents.workers import AgentRef, AgentWorkers
from tracetrain.engines.start import start_engine
from tracetrain.rows.roles import role_engines
from tracetrain.run import checkpoint, policies


@contextlib.asynccontextmanager
async def started(tr, admin_key: str):
    """(gateway client, engine) of the run, started in order and stopped in reverse: the
    store, the engine (and roles.serve's), the agent workers, the in-process gateway, the
    agents' HTTP client."""
    from tracetrain.gateway.app import create_app
    from tracetrain.gateway.inprocess import app_options, bind, serve_in_loop
    from tracetrain.store import SQLiteStore

    cfg = tr.cfg
    tr.store = SQLiteStore(tr.run_dir / "traces.db")
    engines = {}
    try:
        weights, version = tr.sync.engine_weights(tr.version)
        engines["default"] = engine = await start_engine(
            cfg, weights, tr.tokenizer, version=version, run_dir=tr.run_dir,
            threads=tr.threads, log=tr.log, lockstep=tr.lockstep)
        engines.update(await start_role_engines(tr))
        for name, model in tr.whole.items():  # whole-model policies: a local engine each
            engines[policies.engine_name(name)] = await start_engine(
                cfg, model, tr.tokenizer, version=tr.version, run_dir=tr.run_dir,
                threads=tr.threads, log=tr.log, lockstep=tr.lockstep)
        if cfg.rollout.agent_workers:  # agents in their own processes (agents/workers.py)
            tr.workers = AgentWorkers(agent_ref(tr), cfg.rollout.agent_workers,
                                        max_connections=cfg.rollout.concurrency)
        sock = bind(cfg.gateway)  # agents get gateway.public_url (gateway/inprocess.py)
        app = create_app(tr.store, engines, admin_key=admin_key, default_engine="default",
                         **app_options(cfg.gateway, sock.getsockname()[1]))
        gw = app.state.gateway
        gw.role_engines.update(role_engines(cfg.roles.serve))
        policies.serve(gw, cfg, tr.whole)  # each call by its role's policy
        tr.sync.attach(engine, gw.slots["default"])  # held in-process around updates
        for name in tr.whole:  # (each engine of a whole-model policy too)
            tr.sync.attach_whole(engines[policies.engine_name(name)], gw.slots[policies.engine_name(name)])
        async with serve_in_loop(app, sock) as url, agent_http_client(cfg.rollout.concurrency) as http:
            gateway = GatewayClient(url, admin_key)
            tr.http_client = http
            try:
                yield gateway, engine
            finally:
                await gateway.aclose()
    finally:
        if tr.workers is not None:
            tr.workers.close()
        for e in engines.values():
            await e.aclose()
        tr.store.close()
        if tr.update_executor is not None:
            tr.update_executor.shutdown(wait=False)
            tr.update_executor = None


def agent_ref(tr) -> AgentRef:
    """How an agent worker process finds the agent: the task module's file or name, or the
    environment (pickled as its config section)."""
    cfg = tr.cfg
    task_spec = getattr(tr.task, "__file__", None) if cfg.task.endswith(".py") else cfg.task
    env = tr.task if cfg.env is not None else None
    return AgentRef(task_spec or cfg.task, None, cfg.agent, env)


async def start_role_engines(tr) -> dict:
    """The engines of roles.serve's "frozen" roles: a local engine on a copy of the policy as
    training starts (after the warm start; a resumed run's from its checkpoint), given no
    new weights ever."""
    if "frozen" not in tr.cfg.roles.serve.values():
        return {}
    if tr.frozen_model is None:
        tr.frozen_model = checkpoint.frozen_copy(tr.model)
    return {"frozen": await start_engine(tr.cfg, tr.frozen_model, tr.tokenizer, version=0,
                                         run_dir=tr.run_dir, threads=tr.threads,
                                         log=tr.log, lockstep=tr.lockstep)}
