"""`tracetrain eval CONFIG --policy PATH`: a policy on the run's eval tasks, k tries each.

    pass_at_k(n, c, k)     unbiased pass@k of one task: 1 - C(n - c, k) / C(n, k)
                           (n tries, c successes; Chen et al. 2021, "Evaluating Large Language
                           Models Trained on Code")
    evaluate(cfg, task, data, policy=..., k=4, temperature=1.0)   -> (summary, per-task rows)

The summary holds the tools/* metrics of the tries (run/step.py tools_metrics: calls per try,
tries with a call, parse failures, calls of unknown tools, tool errors) when they were offered
tools.

The eval tasks are the run's: the held-out rows of its dataset (data.eval, data.eval_fraction),
else the task module's `tasks` with the eval seed the trainer's eval passes use. Each is played
`k` times (at `temperature` and the config's rollout.top_p) through the same gateway, agents and
engine as training (`engine.kind`: the local engine, or vLLM launched on the policy's weights or
pushed to a running server). A try succeeds when its reward is >= `success`. A try that failed or
timed out (the agent crashed, not a low reward) is counted apart, never as reward 0: pass@k of a
task uses its scored tries (n = those).

The policy: a `policy/` folder (checkpoint.write_policy: a transformers directory), a
`checkpoint.pt`, or none (the config's model as loaded: untrained, no warm start). Several
policies: each role by its policy, as in training (a checkpoint's adapters on the base, its
whole-model policies' models on local engines of their own); a policy/ folder serves every role.
"""

from __future__ import annotations

import json
import math
import secrets
import tempfile
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import ConfigError, TrainConfig
from tracetrain.models.compute import on_compute, one_thread_here
from tracetrain.run.failures import counts, first_error
from tracetrain.types import RunFailed


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k tries drawn without replacement from n (c of them
    successes) succeeds; needs k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def load_eval_policy(cfg: TrainConfig, policy: str | Path | None, *, adapter: bool = False):
    """(model, tokenizer) for `policy` (module docstring). Under LoRA (model.lora; several
    policies: an adapter each) a checkpoint holds the adapters alone: they are loaded onto the
    config's base; a policy/ folder holds a merged model; `adapter=True` (sft, which trains them)
    puts fresh adapters on whatever was loaded."""
    from tracetrain.models import lora
    from tracetrain.models.load import load_policy

    model, tokenizer = load_policy(cfg.model, seed=cfg.trainer.seed)
    path = None if policy is None else Path(policy)
    weights = path is not None and path.is_file()  # a checkpoint (a run's, or sft's weights only)
    if path is not None and path.is_dir():
        from transformers import AutoModelForCausalLM

        if not (path / "config.json").is_file():
            raise ConfigError(f"--policy {str(path)!r}: not a transformers directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    elif path is not None and not weights:
        raise ConfigError(f"--policy {str(path)!r}: no such file or directory")
    if cfg.model.lora is not None and (adapter or weights):
        torch.manual_seed(cfg.trainer.seed)  # the fresh adapter's A, as the trainer draws it
        model = lora.wrap(model, cfg.model.lora)
    if cfg.adapter_policies and (adapter or weights):  # several policies: an adapter each
        torch.manual_seed(cfg.trainer.seed)
        model = lora.wrap_policies(model, cfg.adapter_policies)
    if weights:
        try:
            ck = torch.load(path, weights_only=False, map_location="cpu")
            lora.load_weights(model, ck["model"])
        except Exception as e:  # not a checkpoint of this config's model: say which and why
            raise ConfigError(f"--policy {str(path)!r}: not a checkpoint of this config's model "
                              f"({type(e).__name__}: {e})") from None
    return model.eval(), tokenizer


def load_eval_whole(cfg: TrainConfig, policy: str | Path | None, *, sft: bool = False) -> dict:
    """{whole-model policy: its model} for `policy`: a checkpoint (a run's or sft's) holds each
    (`whole`); none: each as a run starts it (policies.<p>.model, or the config's model); a
    policy/ folder: {} for eval (that one model serves every role), copies of it for sft (each
    starts from it)."""
    from tracetrain.models import lora
    from tracetrain.run import policies

    if not cfg.whole_policies:
        return {}
    path = None if policy is None else Path(policy)
    if path is not None and path.is_dir() and not sft:
        return {}
    model, tokenizer = load_eval_policy(cfg, path if path is not None and path.is_dir() else None)
    whole = policies.whole_models(cfg, lora.base(model), tokenizer)
    if path is not None and path.is_file():
        held = torch.load(path, weights_only=False, map_location="cpu").get("whole", {})
        if sorted(held) != sorted(whole):
            raise ConfigError(f"--policy {str(path)!r}: whole-model policies {sorted(held)}; this "
                              f"config's are {sorted(whole)} (policies.*.lora, policies.*.model)")
        for name, m in whole.items():
            m.load_state_dict(held[name])
    return whole


def eval_tasks(cfg: TrainConfig, task: Any, data, n: int) -> list[dict]:
    """The first n eval tasks (the same for every pass, and for `tracetrain eval` and a run's
    eval passes): the dataset's held-out rows, else the task module's `tasks` with a seed no
    training step uses."""
    held = data.eval_tasks(n) if data is not None else None
    if held is not None:
        return held
    if not callable(getattr(task, "tasks", None)):
        raise ConfigError("config key 'data': no held-out rows (data.eval or data.eval_fraction) "
                          "and the task module has no `tasks` to make eval tasks")
    return task.tasks(n, seed=-(cfg.trainer.seed * 1_000_003 + 1), **cfg.task_args)


def eval_samples(store, tokenizer, tasks: list[dict], results: list, n: int = 8) -> list[dict]:
    """The first `n` tries of an eval pass (`results[j]` played `tasks[j]`) as table rows:
    task (its JSON), reply (the text of its last turn's response), reward (None: no reward, the
    try failed or timed out)."""
    results = results[:n]
    played = {r.rollout_id: r for r in store.load_rollouts(rollout_ids=[r.rollout_id for r in results])}
    rows = []
    for t, r in zip(tasks, results, strict=False):
        turns = played[r.rollout_id].turns if r.rollout_id in played else []
        reply = tokenizer.decode(list(turns[-1].response_ids), skip_special_tokens=True) if turns else ""
        rows.append({"task": json.dumps(t, default=str), "reply": reply,
                     "reward": r.reward if r.state == "succeeded" else None})
    return rows


async def evaluate(cfg: TrainConfig, task: Any, data, *, policy=None, k: int = 4,
                   temperature: float = 1.0, n_tasks: int | None = None, success: float = 1.0,
                   store_dir: Path | None = None, log=print) -> tuple[dict, list[dict]]:
    """Play each eval task k times with the policy; (summary, one row per task). RunFailed, with
    the first failed try's error, when no try succeeded (failed or timed out: nothing scored)."""
    from tracetrain.engines.start import preflight

    if k < 1:
        raise ConfigError(f"--k must be >= 1, got {k}")
    preflight(cfg)  # before loading anything: e.g. the interpreter must run vLLM
    tasks = eval_tasks(cfg, task, data, n_tasks or cfg.trainer.eval_tasks)
    # loaded where the engine decodes; this thread at one torch thread (models/compute.py)
    threads = cfg.engine.threads or torch.get_num_threads()
    model, tokenizer = on_compute(threads, load_eval_policy, cfg, policy)
    whole = on_compute(threads, load_eval_whole, cfg, policy)
    with one_thread_here():
        results, tools = await _play(cfg, task, tasks, model, tokenizer, whole, k=k,
                                     temperature=temperature, store_dir=store_dir, log=log)
    summary, rows = tally(tasks, results, k, success)
    if results and all(r.state != "succeeded" for r in results):
        raise RunFailed(f"every eval rollout failed ({counts(results)}): {first_error(results)}")
    return {**summary, **tools, "temperature": temperature, "top_p": cfg.rollout.top_p,
            "policy": str(policy) if policy else "untrained"}, rows


async def _play(cfg: TrainConfig, task: Any, tasks: list[dict], model, tokenizer, whole: dict, *,
                k: int, temperature: float, store_dir: Path | None, log) -> tuple[list, dict]:
    """The k tries of each of `tasks` through a gateway and engines of their own: (the results
    in task order, their tools/* metrics: run/step.py tools_metrics)."""
    from tracetrain.agents.lockstep import Lockstep
    from tracetrain.agents.runner import GatewayClient, agent_http_client
    from tracetrain.agents.tasks import resolve_agent
    from tracetrain.engines.start import start_engine
    from tracetrain.gateway.app import create_app
    from tracetrain.gateway.inprocess import serve_in_loop
    from tracetrain.models import lora
    from tracetrain.run import policies
    from tracetrain.run.step import collect, rollout_specs, tools_metrics
    from tracetrain.store import SQLiteStore

    if cfg.model.lora is not None and not lora.is_lora(model):
        # a merged policy/ or the untrained base: an engine serves it whole, not base + adapter
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
    if cfg.policies is not None and not lora.adapter_names(model) and not whole:  # (likewise, every role)
        cfg = cfg.model_copy(update={"policies": None})
    agent = resolve_agent(task, cfg.agent)
    with tempfile.TemporaryDirectory(prefix="tracetrain-eval-") as tmp:
        store = SQLiteStore((store_dir or Path(tmp)) / "eval_traces.db")
        lockstep = Lockstep() if cfg.reproducible else None  # the same tries on every call
        engines = {}
        for name, m in {"default": model, **{policies.engine_name(p): w for p, w in whole.items()}}.items():
            engines[name] = await start_engine(cfg, m, tokenizer, version=0, run_dir=Path(tmp),
                                               threads=cfg.engine.threads, log=log, lockstep=lockstep)
        admin_key = secrets.token_urlsafe(24)
        app = create_app(store, engines, admin_key=admin_key, default_engine="default")
        if cfg.policies is not None:  # each role by its policy, as in training
            policies.serve(app.state.gateway, cfg, whole)
        try:
            async with serve_in_loop(app) as url, agent_http_client(cfg.rollout.concurrency) as http:
                gateway = GatewayClient(url, admin_key)
                try:
                    specs = rollout_specs(tasks, k, f"eval-{secrets.token_hex(3)}")
                    results = await collect(gateway, specs, agent, cfg, temperature=temperature,
                                            step=0, http_client=http, trains=False,
                                            lockstep=lockstep)
                finally:
                    await gateway.aclose()
            played = store.load_rollouts(rollout_ids=[r.rollout_id for r in results])
            tools = tools_metrics(store, played)
        finally:
            for engine in engines.values():
                await engine.aclose()
            store.close()
    return results, tools


def tally(tasks: list[dict], results: list, k: int, success: float) -> tuple[dict, list[dict]]:
    """(summary, one row per task) of k tries per task (`results` in task order): each task's
    scored rewards, failed tries, successes (reward >= success), pass@1 and pass@k."""
    rows = []
    for j, t in enumerate(tasks):
        mine = results[j * k:(j + 1) * k]
        scored = [r.reward for r in mine if r.state == "succeeded" and r.reward is not None]
        c = sum(x >= success for x in scored)
        errors = [r.error for r in mine if r.state != "succeeded" and r.error]
        rows.append({"task": t, "rewards": scored, "failed": len(mine) - len(scored),
                     "errors": errors,
                     "successes": c,
                     "pass@1": pass_at_k(len(scored), c, 1) if scored else None,
                     f"pass@{k}": pass_at_k(len(scored), c, k) if len(scored) >= k else None})
    rewards = [x for r in rows for x in r["rewards"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    summary = {"tasks": len(rows), "tries": len(rows) * k, "failed": sum(r["failed"] for r in rows),
               "reward_mean": mean(rewards),
               "pass@1": mean([r["pass@1"] for r in rows if r["pass@1"] is not None]),
               f"pass@{k}": mean([r[f"pass@{k}"] for r in rows if r[f"pass@{k}"] is not None])}
    return summary, rows
