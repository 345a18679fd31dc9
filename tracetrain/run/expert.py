"""The warm start from an expert (warm_start.expert): demonstrations in the policy's own tokens,
then supervised steps on them, before RL.

    scripted, model   the expert plays `rollouts` rollouts of the training tasks (one each, in the
                      run's task order) with the run's own agent or environment, through a gateway
                      of its own whose one engine is the expert (engines/expert.py): recorded in
                      run_dir/traces.db on engine "expert" (the viewer marks them), rewarded as
                      RL's rollouts are; kept: succeeded, reward >= min_reward when given
    file              each conversation of the file (TRL's conversational format: `messages`,
                      optional `tools`) is a rollout of one turn per assistant message: prompt the
                      template's render of the messages before it, response its reply's ids
                      (tool_prompt.reply_ids); all kept
    steps             warm_start.steps AdamW steps, each on warm_start.batch_size kept rollouts
                      drawn at random, on the RL path's rows (learn/sft.py fine_tune_steps):
                          L = - sum_{i,t} w[i,t] log p(response token t of row i)
                      every reply token of the expert's trained, nothing of the environment's

Nothing here is the policy's reward: these rollouts are never in a step's collection, and what
the phase measured goes to run_dir/warm_start.json and the log, under warm_start/.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

from tracetrain.config import ConfigError, TrainConfig
from tracetrain.engines.expert import ExpertEngine, chat_expert
from tracetrain.models.tool_prompt import chat_text, reply_ids, writes_block
from tracetrain.run.failures import error_line
from tracetrain.run.step import collect, rollout_specs, step_tasks
from tracetrain.types import Rollout, RolloutState, Turn

EXPERT = "expert"  # the engine name its rollouts are recorded on


def load_expert(cfg: TrainConfig):
    """warm_start.expert (scripted or model) as `async (messages, tools) -> reply`."""
    ex = cfg.warm_start.expert
    if ex.kind == "model":
        m = ex.model
        return chat_expert(m.url, m.name, api_key_env=m.api_key_env, temperature=ex.temperature,
                           max_tokens=ex.max_tokens)
    from tracetrain.envs.base import EnvError, load_object

    try:
        fn = load_object(ex.path, "warm_start.expert.path")
    except EnvError as e:
        raise ConfigError(str(e)) from None
    if not callable(fn):
        raise ConfigError(f"config key 'warm_start.expert.path': {ex.path!r} is not a function")

    async def expert(messages: list[dict], tools: list | None):
        reply = fn(messages, tools)
        return await reply if inspect.isawaitable(reply) else reply

    return expert


def expert_tasks(task: Any, cfg: TrainConfig, data: Any, n: int) -> list[dict]:
    """The first `n` training tasks in the run's order (steps 0, 1, ... of rollout.tasks_per_step)."""
    tasks: list[dict] = []
    step = 0
    while len(tasks) < n:
        tasks += step_tasks(task, cfg, step, data)
        step += 1
    return tasks[:n]


async def play(cfg: TrainConfig, task: Any, data: Any, agent: Any, tokenizer: Any, *,
               run_dir: Path, admin_key: str, nonce: str, max_context: int
               ) -> tuple[list[Rollout], list[str]]:
    """The expert's rollouts (module docstring), played through a gateway on run_dir/traces.db
    with the expert as its one engine: every finished one, as the store loads them, and the
    errors of those that failed."""
    from tracetrain.agents.runner import GatewayClient, agent_http_client
    from tracetrain.gateway.app import create_app
    from tracetrain.gateway.inprocess import app_options, bind, serve_in_loop
    from tracetrain.store import SQLiteStore

    ex = cfg.warm_start.expert
    engine = ExpertEngine(tokenizer, load_expert(cfg), max_context=max_context,
                          inject=writes_block(tokenizer, cfg.gateway.tool_parser))
    specs = rollout_specs(expert_tasks(task, cfg, data, ex.rollouts), 1, f"{nonce}-{EXPERT}",
                          engines=(EXPERT,))
    store = SQLiteStore(run_dir / "traces.db")
    try:
        sock = bind(cfg.gateway)
        app = create_app(store, {EXPERT: engine}, admin_key=admin_key, default_engine=EXPERT,
                         **app_options(cfg.gateway, sock.getsockname()[1]))
        async with (serve_in_loop(app, sock) as url,
                    agent_http_client(cfg.rollout.concurrency) as http):
            gateway = GatewayClient(url, admin_key)
            try:
                await collect(gateway, specs, agent, cfg, temperature=cfg.rollout.temperature,
                              step=0, http_client=http, trains=False)
            finally:
                await gateway.aclose()
        ids = [s["rollout_id"] for s in specs]
        errors = [r.error for r in map(store.get_rollout, ids) if r is not None and r.error]
        return store.load_rollouts(rollout_ids=ids), errors
    finally:
        store.close()


def kept(rollouts: list[Rollout], min_reward: float | None) -> list[Rollout]:
    """Succeeded rollouts with a reward (>= min_reward when given) and at least one turn."""
    return [r for r in rollouts
            if str(getattr(r.state, "value", r.state)) == RolloutState.succeeded.value
            and r.reward is not None and r.turns
            and (min_reward is None or r.reward >= min_reward)]


def file_rollouts(path: Path, tokenizer: Any, tool_parser: str) -> list[Rollout]:
    """The conversations of a TRL conversational file as rollouts (module docstring), reward 1."""
    from tracetrain.agents.dataset import open_rows

    rows, inject, out = open_rows(path), writes_block(tokenizer, tool_parser), []
    for i in range(len(rows)):
        row = rows[i]
        messages, tools = row.get("messages"), row.get("tools") or None
        if isinstance(tools, str):  # a JSON column (CSV, some Parquet writers)
            tools = json.loads(tools)
        if not isinstance(messages, list) or not any(m.get("role") == "assistant" for m in messages):
            raise ConfigError(f"config key 'warm_start.expert.path': {path} row {i} has no "
                              "'messages' list with an assistant message")
        turns = []
        for k, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            text = chat_text(tokenizer, messages[:k], tools, generation_prompt=True, inject=inject)
            prompt = tokenizer.encode(text, add_special_tokens=False)
            turns.append(Turn(prompt, reply_ids(tokenizer, messages[:k], tools, m, inject=inject),
                              None, None))
        out.append(Rollout(f"{EXPERT}-file-{i}", f"{EXPERT}-file-{i}", turns, 1.0))
    return out


def report(played: list[Rollout] | None, chosen: list[Rollout], losses: list[float],
           seconds: float) -> dict[str, float]:
    """warm_start/* : what the phase measured (played: None for a file)."""
    out = {"warm_start/demonstrations": len(chosen), "warm_start/steps": len(losses),
           "warm_start/loss_first": losses[0], "warm_start/loss_last": losses[-1],
           "warm_start/seconds": seconds}
    if played is not None:
        rewards = [r.reward for r in played if r.reward is not None
                   and str(getattr(r.state, "value", r.state)) == RolloutState.succeeded.value]
        out["warm_start/expert_rollouts"] = len(played)
        out["warm_start/expert_failed"] = len(played) - len(rewards)
        out["warm_start/expert_reward_mean"] = math.fsum(rewards) / len(rewards) if rewards else 0.0
    return out


async def warm_start(learner, cfg: TrainConfig, task: Any, data: Any, agent: Any, *,
                     run_dir: Path, admin_key: str, nonce: str, update_thread,
                     log=print) -> dict[str, float]:
    """The whole phase (module docstring) on `learner`'s model; its report, also written to
    run_dir/warm_start.json."""
    from tracetrain.learn.sft import dedupe, fine_tune_steps, sft_rows
    from tracetrain.models import lora
    from tracetrain.run import policies

    ws, t, tok = cfg.warm_start, time.perf_counter(), learner.tokenizer
    if ws.expert.kind == "file":
        played, chosen = None, dedupe(file_rollouts(Path(ws.expert.path), tok, cfg.gateway.tool_parser))
    else:
        max_context = getattr(learner.model.config, "max_position_embeddings", None) or 32768
        played, errors = await play(cfg, task, data, agent, tok, run_dir=run_dir, admin_key=admin_key,
                            nonce=nonce, max_context=max_context)
        chosen = dedupe(kept(played, ws.expert.min_reward))
        if errors and chosen:
            log(f"warm start: {len(errors)} of the expert's {len(played)} rollouts failed; the "
                f"first error: {error_line(errors[0])}")
        if not chosen:
            raise ConfigError(f"config key 'warm_start.expert': none of its {len(played)} rollouts "
                              f"is kept ({len(errors)} failed; min_reward {ws.expert.min_reward})"
                              + (f"; the first error: {error_line(errors[0])}" if errors else ""))
    batch = sft_rows(chosen, cfg, tok.pad_token_id or 0)
    with lora.base_trainable(learner.model) if cfg.adapter_policies else contextlib.nullcontext():
        losses = await update_thread.run(  # nothing else runs yet: the larger thread count
            max(update_thread.threads, update_thread.update_threads), fine_tune_steps,
            learner.model, batch, cfg, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
            seed=cfg.trainer.seed)
    policies.copy_base(cfg, learner.model, learner.whole)  # several policies: the shared backbone
    out = report(played, chosen, losses, time.perf_counter() - t)
    (run_dir / "warm_start.json").write_text(json.dumps(out, indent=2))
    log("warm start from the expert: " + ", ".join(
        f"{k.removeprefix('warm_start/')} {v:.3f}" if isinstance(v, float) else
        f"{k.removeprefix('warm_start/')} {v}" for k, v in out.items()))
    return out
