"""One training step, as stages over plain data, shared by every backend and engine.

    collect   step_tasks -> rollout_specs -> the runner plays each rollout's agent through the
              gateway, whose engine (local, vLLM, verl's servers) answers and records the turns
    rows      the store's rollouts -> stale ones dropped -> aggregate -> advantages   (`rows`)
    learn     mini-batches of whole rollouts -> optimizer updates
    sync      the engine takes the new weights; the model version goes up by one

`collect` runs the agents (agents/runner.py, runner_ray.py, workers.py), `learn` and `sync` are
the backend's (the embedded trainer: run/learner.py's update and run/weights.py's WeightSync;
verl: its actor and checkpoint manager). What every backend logs of a step comes from `rows` and `throughput`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tracetrain.agents.runner import run_rollouts
from tracetrain.config import ConfigError, TrainConfig
from tracetrain.objective.credit import batch_credit
from tracetrain.objective.distill import distill_advantages
from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.batch import TrainingBatch
from tracetrain.rows.context_metrics import context_metrics
from tracetrain.rows.roles import role_metrics, trains
from tracetrain.rows.tool_metrics import tool_metrics
from tracetrain.run.teacher import teacher_scores
from tracetrain.types import TOOL_ERRORS, Rollout


def step_seed(cfg: TrainConfig, step: int) -> int:
    """The seed of step `step`'s tasks and sampling: a function of (trainer.seed, step) only, so a
    resumed run sees the same."""
    return cfg.trainer.seed * 1_000_003 + step


def step_tasks(task_module: Any, cfg: TrainConfig, step: int, data=None) -> list[dict]:
    """The tasks of step `step`: from the run's dataset (`data`: dataset.TaskData, epochs in a
    seeded order) when it has one, else the task module's `tasks`."""
    if data is not None:
        return data.train_tasks(step, cfg.rollout.tasks_per_step)
    return task_module.tasks(cfg.rollout.tasks_per_step, seed=step_seed(cfg, step), **cfg.task_args)


def rollout_specs(
    tasks: list[dict], n_per_task: int, prefix: str, engines: Sequence[str] = ()
) -> list[dict]:
    """n_per_task rollouts of each task, one group per task; with `engines`, the groups are dealt
    to them in turn (a group stays on one engine)."""
    return [
        {"rollout_id": f"{prefix}-t{j}-n{m}", "group_id": f"{prefix}-t{j}", "task": task,
         **({"engine": engines[j % len(engines)]} if engines else {})}
        for j, task in enumerate(tasks)
        for m in range(n_per_task)
    ]


def check_top_p(cfg: TrainConfig) -> None:
    """ConfigError naming rollout.top_p when it is < 1 and the PPO ratio would be taken against
    logprobs of another kind than the trainer's. The local engine records log p(y) of the full
    temperature-scaled distribution, the trainer's own; vLLM and SGLang (engine.kind vllm, verl's
    rollout servers) record them after top-p, renormalised over the nucleus: log p(y) - log S,
    which starts the ratio at S < 1 (engines/sampling.py). Allowed: top_p 1; engine.kind local;
    backend embedded with correction.old trainer and no correction (the ratio is then against
    the trainer's own logprobs and the engine's feed only the logged gap)."""
    rc, cc = cfg.rollout, cfg.correction
    if rc.top_p == 1 or cfg.backend == "embedded" and (cfg.engine.kind == "local" or (
            cc.old == "trainer" and cc.weight == "none" and cc.mask == "none" and cc.reject is None)):
        return
    where = f"backend {cfg.backend!r}" if cfg.backend != "embedded" else f"engine.kind {cfg.engine.kind!r}"
    raise ConfigError(
        f"config key 'rollout.top_p': {rc.top_p} < 1 is not supported with {where}: its engine "
        "records logprobs renormalised over the top-p nucleus (log p - log S), not the full "
        "temperature-scaled log p the trainer computes, and the PPO ratio against them would "
        "start at S < 1 instead of 1. Use rollout.top_p: 1"
        + (", engine.kind: local, or correction.old: trainer with no correction"
           if cfg.backend == "embedded" else ""))


async def collect(gateway, specs: list[dict], agent, cfg: TrainConfig, *, temperature: float,
                  step: int, http_client=None, workers=None, first_position: int = 0,
                  trains: bool = True, lockstep=None) -> list:
    """The collect stage: each rollout of `specs` played by `agent` through the gateway, its model
    calls sampled at `temperature` and rollout.top_p (the agents get client["temperature"],
    client["top_p"] and client["max_tokens"]) with step `step`'s seed; results in the order of
    `specs`. `trains`: the rollouts will be trained on (check_top_p; false for an eval).
    runner "ray": the agents are Ray tasks; `workers` (agents/workers.py AgentWorkers): they run in
    those processes; else as coroutines here (on `http_client`'s connections when given).
    `first_position`: where `specs` start among the step's rollouts (their sampling seeds).
    `lockstep` (agents/lockstep.py): the agents are counted in it (not on Ray)."""
    if trains:
        check_top_p(cfg)
    rc = cfg.rollout
    extra = {"model": "policy", "temperature": temperature, "top_p": rc.top_p,
             "max_tokens": rc.max_tokens, "seed": step_seed(cfg, step)}
    limits = {"concurrency": rc.concurrency, "timeout_s": rc.timeout_s, "client_extra": extra,
              "first_position": first_position}
    if cfg.runner == "ray":  # agents as Ray tasks (RAY_ADDRESS, else a local Ray)
        from tracetrain.agents.runner_ray import run_rollouts_ray

        return await run_rollouts_ray(gateway, specs, agent, **limits)
    if workers is not None:
        from tracetrain.agents.workers import run_rollouts_in_workers

        return await run_rollouts_in_workers(gateway, specs, workers, **limits, lockstep=lockstep)
    return await run_rollouts(gateway, specs, agent, **limits, http_client=http_client,
                              lockstep=lockstep)


# The error of a rollout still queued or running when its run ended (`end_unfinished`).
NEVER_TRAINED = "cancelled: the run ended before this rollout finished; never trained"


async def end_unfinished(store, prefix: str | None, log=print) -> int:
    """Fail every rollout of the groups `prefix`-* (`prefix`: no glob characters; None: every
    group) still queued or running, with the error NEVER_TRAINED, and `log` how many; returns how
    many. For the end of a run, after its collects are cancelled, and the start of a resumed one
    (what a killed process left running): nothing else ends them. Failed is an infrastructure
    state: such a rollout is never trained, nor counted as reward 0."""
    import asyncio

    from tracetrain.store import IllegalTransition

    unfinished = []
    for state in ("queued", "running"):
        after = 0
        glob = None if prefix is None else f"{prefix}-*"
        while page := store.list_rollouts(state=state, group_glob=glob, after=after, limit=1000):
            unfinished += [r.rollout_id for r in page]
            after = page[-1].seq

    async def fail(rollout_id: str) -> bool:
        try:
            await store.set_state(rollout_id, "failed", NEVER_TRAINED)
        except IllegalTransition:  # it ended meanwhile (its runner's finish was on its way)
            return False
        return True

    # (the store commits the writes of one event-loop turn together)
    n = sum(await asyncio.gather(*map(fail, unfinished)))
    if n:
        log(f"{n} rollouts still running at the end of the run: failed, {NEVER_TRAINED!r}")
    return n


def drop_stale(
    rollouts: list[Rollout], current_version: int, max_staleness: int,
    train_roles: Collection[str] | None = None,
) -> tuple[list[Rollout], int]:
    """Drop rollouts with a trained turn made by a model more than max_staleness versions old
    (counted). The turns of roles that do not train (e.g. served by a frozen copy, whose version
    never moves) do not count."""
    keep, n_stale = [], 0
    for r in rollouts:
        versions = [t.model_version for t in r.turns
                    if t.model_version is not None and trains(t.role, train_roles)]
        if versions and current_version - min(versions) > max_staleness:
            n_stale += 1
        else:
            keep.append(r)
    return keep, n_stale


def staleness_counts(rollouts: list, version: int, train_roles) -> dict[str, Any]:
    """staleness/... of the rollouts a step trains at `version`: a histogram of the rollouts by
    version - their oldest trained turn's version (rollouts_<d>), of the trained tokens by
    version - their turn's version (tokens_<d>), and mixed_version_rollouts (trained turns from
    more than one version)."""
    out: dict[str, Any] = {"staleness/mixed_version_rollouts": 0}
    for r in rollouts:
        turns = [t for t in r.turns if t.model_version is not None and trains(t.role, train_roles)]
        if not turns:
            continue
        versions = {t.model_version for t in turns}
        key = f"staleness/rollouts_{version - min(versions)}"
        out[key] = out.get(key, 0) + 1
        out["staleness/mixed_version_rollouts"] += len(versions) > 1
        for t in turns:
            key = f"staleness/tokens_{version - t.model_version}"
            out[key] = out.get(key, 0) + len(t.response_ids)
    return out


# engine.stats that add up, per step (local: batches...; vllm: requests, retries...)
ENGINE_WORK = ("batches", "requests", "forward_calls", "prompt_tokens", "prefill_tokens",
               "prefix_cache_tokens", "attempts", "retries", "failures")


def engine_metrics(work: dict[str, int]) -> dict[str, float]:
    """engine/<k> of a step's engine work (ENGINE_WORK), and engine/prefix_hit_rate: the share
    of the prompt tokens the local engine read from its prefix cache (engines/prefix_cache.py)."""
    out: dict[str, float] = {f"engine/{k}": v for k, v in work.items()}
    if work.get("prompt_tokens"):
        out["engine/prefix_hit_rate"] = work.get("prefix_cache_tokens", 0) / work["prompt_tokens"]
    return out


@dataclass
class Collected:
    """The rollouts of one step: results, seconds, the engine's work and the oldest model version
    that generated them (the engine's at the start of the collect, or at a group's launch), and
    what the collect measured (`metrics`)."""

    step: int
    results: list
    seconds: float
    engine_work: dict[str, int]
    engine_version: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


def collected_of(step: int, *candidates: Any) -> Collected | None:
    """The rollouts of step `step` among `candidates` (each a Collected, the task of an
    overlapped collect, done or not, or None), or None: what a stopped run keeps in its
    checkpoint so that a resumed run trains them instead of collecting the step again."""
    for c in candidates:
        if hasattr(c, "done"):  # a task: its result once it finished whole
            c = c.result() if c.done() and not c.cancelled() and c.exception() is None else None
        if isinstance(c, Collected) and c.step == step:
            return c
    return None


class Rows(NamedTuple):
    batch: TrainingBatch
    # [n_rollouts] one per rollout, or [rows, S] one per token of a turn-level estimator
    # (credit.batch_credit) or with a teacher (objective/distill.py); None when there is no row
    advantages: Any
    metrics: dict[str, Any]


def build_rows(store, results: Sequence[Any], cfg: TrainConfig, tokenizer, version: int) -> Rows:
    """The rows stage: the step's rollouts (`results`: the runner's, with rollout_id, state and
    reward) read from the store, those older than trainer.max_staleness versions behind `version`
    dropped, aggregated into rows, and given their advantages.

    metrics: reward_mean (over succeeded rollouts with a reward), n_failed, n_timed_out,
    n_stale_rollouts, staleness/* (`staleness_counts`), aggregate/*, context/* (how the prompts
    were built), roles/* and turn_rewards/* (roles.role_metrics), env/* (`env_metrics`), tools/*
    (over the step's rollouts, stale ones too: `tools_metrics`), advantage/*, distill/* (with a
    teacher: objective/distill.py on its scores, which run/teacher.py wrote to the store),
    entropy/sampled, time/rows_s.

    entropy/sampled: the mean over the trained tokens of -(the engine's logprob), the sampling
    policy's per-token entropy estimated from its own samples (E_{a~pi} -log pi(a) = H(pi), at
    the rollout temperature); free, where loss/entropy needs a pass over the vocabulary."""
    t0 = time.perf_counter()
    ids = [r.rollout_id for r in results]
    ac, train_roles = cfg.aggregate, cfg.roles.train
    loaded, reports = store.load_rollouts(rollout_ids=ids), rollout_reports(store, ids)
    rollouts, n_stale = drop_stale(loaded, version, cfg.trainer.max_staleness, train_roles)
    batch, agg = aggregate(rollouts, level=ac.level, max_prompt_length=ac.max_prompt_length,
                           max_response_length=ac.max_response_length,
                           pad_token_id=tokenizer.pad_token_id or 0, tokenizer=tokenizer,
                           overlong=ac.overlong, train_roles=train_roles)
    states = [r.state for r in results]
    rewards = [r.reward for r in results if r.state == "succeeded" and r.reward is not None]
    metrics: dict[str, Any] = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "n_failed": states.count("failed"),
        "n_timed_out": states.count("timed_out"),
        "n_stale_rollouts": n_stale,
        **{f"aggregate/{k}": v for k, v in agg.items() if isinstance(v, (int, float))},
        **context_metrics(store.turn_contexts(ids)),
        **role_metrics(rollouts, train_roles),
        **staleness_counts(rollouts, version, train_roles),
        **env_metrics(store, ids, reports),
        **tools_metrics(store, loaded, reports),
    }
    adv = None
    if batch.n_rows:
        ad = cfg.advantage
        batch, adv, adv_metrics = batch_credit(
            batch, rollouts, estimator=ad.estimator, train_roles=train_roles, gamma=ad.gamma,
            step_weight=ad.step_weight, eps=ad.eps, failed_rollouts=ad.failed_rollouts,
            others=cfg.other_policies_roles)
        metrics.update({f"advantage/{k}": v for k, v in adv_metrics.items()})
        if cfg.distill is not None:  # the teacher's per-token term (objective/distill.py)
            adv, more = distill_advantages(batch, adv, teacher_scores(store, batch.rollouts),
                                           coef=cfg.distill.coef,
                                           with_reward=cfg.distill.with_reward)
            metrics.update(more)
        if batch.rollout_logprobs is not None:
            trained = batch.rollout_logprobs[batch.response_mask].double()
            metrics["entropy/sampled"] = float(-trained.mean()) if trained.numel() else 0.0
    metrics["time/rows_s"] = time.perf_counter() - t0
    return Rows(batch, adv, metrics)


def rollout_reports(store, rollout_ids: Sequence[str]) -> dict[str, dict[str, float]]:
    """rollout id -> name -> what the rollout's `metrics` events reported under `name` (a
    verifiers rubric's functions, an environment class's reward functions, `tool_errors`): its
    last finite number."""
    out: dict[str, dict[str, float]] = {}
    for rid in rollout_ids:
        mine = out.setdefault(rid, {})
        for event in store.list_events(rid, kind="metrics"):
            payload = event.payload if isinstance(event.payload, dict) else {}
            mine.update({str(k): float(v) for k, v in payload.items()
                         if isinstance(v, (int, float)) and math.isfinite(v)})
    return out


def env_metrics(store, rollout_ids: Sequence[str],
                reports: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """env/<name>: the mean over the rollouts that reported `name` of what the environment
    reported (`rollout_reports`; given as `reports` when read already)."""
    values: dict[str, list[float]] = {}
    for mine in (rollout_reports(store, rollout_ids) if reports is None else reports).values():
        for k, v in mine.items():
            values.setdefault(k, []).append(v)
    return {f"env/{k}": math.fsum(v) / len(v) for k, v in sorted(values.items())}


def tools_metrics(store, rollouts: Sequence[Rollout],
                  reports: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """tools/* (rows/tool_metrics.py) of `rollouts` (their turns' tool stats, as the store loads
    them) with the tool errors (types.TOOL_ERRORS) their `metrics` events reported
    (`rollout_reports`; given as `reports` when read already); {} when none was offered tools."""
    if reports is None:
        reports = rollout_reports(store, [r.rollout_id for r in rollouts])
    return tool_metrics(rollouts, {rid: m[TOOL_ERRORS] for rid, m in reports.items()
                                   if TOOL_ERRORS in m})


def throughput(n_rollouts: int, batch: TrainingBatch, collect_s: float, train_s: float) -> dict:
    """time/collect_s, time/train_s, rollouts_per_s, trained_tokens_per_s, rows_per_rollout."""
    n_tokens = int(batch.response_mask.sum()) if batch.n_rows else 0
    return {"time/collect_s": collect_s, "time/train_s": train_s,
            "rollouts_per_s": n_rollouts / max(collect_s, 1e-9),
            "trained_tokens_per_s": n_tokens / max(train_s, 1e-9),
            "rows_per_rollout": batch.n_rows / max(1, batch.n_rollouts)}


def update_metrics(updates: list) -> dict[str, float]:
    """A step's metrics of its updates (update.UpdateResult): means over them, the correction's,
    the engine-trainer logprob gap and the seconds per phase (time/update/*) of the first."""
    n, out = len(updates), {**(updates[0].correction or {}), **(updates[0].times or {})}
    if updates[0].logprob_gap is not None:
        out["engine/logprob_gap_mean"] = updates[0].logprob_gap["mean"]
        out["engine/logprob_gap_max"] = updates[0].logprob_gap["max"]
    out["loss"] = sum(u.loss for u in updates) / n
    out["grad_norm"] = sum(u.grad_norm for u in updates) / n
    out.update({f"loss/{k}": sum(u.metrics[k] for u in updates) / n for k in updates[0].metrics})
    return out


class EngineClock:
    """How idle the engine was between two steps: 1 - busy seconds / wall seconds (its gateway
    slot's busy time), and the engine's stats at the last step (continuous.take_step's base)."""

    def __init__(self, slot, engine):
        self.slot, self.engine = slot, engine
        self.wall, self.busy, self.stats = time.perf_counter(), slot.busy_seconds(), dict(engine.stats)

    def idle_since_last(self) -> float:
        wall, busy = time.perf_counter(), self.slot.busy_seconds()
        idle = 1 - (busy - self.busy) / max(wall - self.wall, 1e-9)
        self.wall, self.busy, self.stats = wall, busy, dict(self.engine.stats)
        return idle

    def idle_shares(self, update_s: float) -> dict[str, float]:
        """The shares of the wall time since the last step in which each side did not compute:
        engine/idle_frac (idle_since_last) and time/update_idle_frac (1 - the update's seconds,
        `update_s`, over that time)."""
        span = max(time.perf_counter() - self.wall, 1e-9)
        return {"engine/idle_frac": self.idle_since_last(), "time/update_idle_frac": 1 - update_s / span}
