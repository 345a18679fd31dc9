"""The teacher of on-policy distillation (config `distill`): loaded once, scoring each step's
rollouts before their rows are made.

    teachers = await load_teachers(cfg, tokenizer, threads)    {policy or None: engine}
    metrics  = await teach(teachers, store, results, cfg)      scores written to the store
    scores   = teacher_scores(store, rollout ids)              what build_rows reads back

The teacher scores the response tokens of every turn of a role it teaches (engines/score.py),
and the scores go to the store as one event of kind "teacher" per rollout and teacher:
{"teacher": policy or "", "turns": {turn index: [logprob per response token]}}. The teacher is
frozen, so when it scores does not change what it says: a resumed run reads the scores of a
rollout scored before the stop (JSON floats: the same numbers) and scores only the others; the
viewer reads them to show each token's teacher logprob.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from tracetrain.config import ConfigError, DistillConfig, ModelConfig, TrainConfig
from tracetrain.engines.score import score
from tracetrain.rows.roles import trains

EVENT = "teacher"
PROBE = ("The teacher's tokenizer must be the policy's: 12 + 7 = 19, naïve café, 東京, "
         "<tool_call>{\"name\": \"x\"}</tool_call>\n\n  indented\tTAB")


def taught_policies(cfg: TrainConfig) -> dict[str | None, DistillConfig]:
    """{policy: its teacher's section} ({None: cfg.distill} for a run of one policy)."""
    if cfg.policies is None:
        return {} if cfg.distill is None else {None: cfg.distill}
    return {name: pc.distill for name, pc in cfg.policies.items() if pc.distill is not None}


def key_of(policy: str | None) -> str:
    return "distill" if policy is None else f"policies.{policy}.distill"


def same_tokenizer(student: Any, teacher: Any) -> str | None:
    """None when the two tokenizers map text to the same ids (the same vocabulary, the same
    encoding of PROBE), else what differs."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        return f"vocabularies of {len(a)} and {len(b)} tokens differ"
    ea, eb = student.encode(PROBE), teacher.encode(PROBE)
    return None if ea == eb else f"they encode the same text as {ea[:8]}... and {eb[:8]}..."


def _name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


async def load_teacher(dc: DistillConfig, tokenizer: Any, cfg: TrainConfig, *, key: str,
                       threads: int):
    """The teacher's engine: a LocalEngine over the loaded model, or an UpstreamEngine for a
    served one; ConfigError naming `key`.teacher when its tokenizer is not the policy's."""
    import asyncio

    if isinstance(dc.teacher, ModelConfig):
        from tracetrain.engines.layers import Unservable
        from tracetrain.engines.local import LocalEngine
        from tracetrain.models.compute import on_compute
        from tracetrain.models.load import load_policy

        n = dc.threads or threads
        model, own = on_compute(n, load_policy, dc.teacher, seed=cfg.trainer.seed,
                                key=f"{key}.teacher")
        why = same_tokenizer(tokenizer, own)
        if why:
            raise ConfigError(f"config key '{key}.teacher': its tokenizer ({_name(own)}) is not "
                              f"the policy's ({_name(tokenizer)}, config key 'model'): {why}; a "
                              "teacher must share the policy's tokenizer")
        model.requires_grad_(False)
        try:
            return LocalEngine(model, own, name="teacher", threads=n,
                               precision=getattr(cfg.engine, "precision", "fp32"))
        except Unservable as e:  # before any work, as the policy's own engine (engines/start.py)
            raise ConfigError(f"config key '{key}.teacher': {e}") from None
    from tracetrain.engines.upstream import UpstreamEngine

    rc = dc.teacher
    root = rc.url.rstrip("/").removesuffix("/v1")
    key_env = None
    if rc.api_key_env:
        import os

        key_env = os.environ.get(rc.api_key_env)
        if not key_env:
            raise ConfigError(f"config key '{key}.teacher.api_key_env': ${rc.api_key_env} is not set")
    engine = UpstreamEngine(root, rc.name, tokenizer, name="teacher", api_key=key_env,
                            max_context=1 << 30)
    why = await asyncio.to_thread(_remote_tokenizer, root, rc.name, tokenizer, key_env)
    if why:
        await engine.aclose()
        raise ConfigError(f"config key '{key}.teacher': the tokenizer of {rc.name!r} at {rc.url} "
                          f"is not the policy's ({_name(tokenizer)}, config key 'model'): {why}")
    return engine


def _remote_tokenizer(root: str, name: str, tokenizer: Any, api_key: str | None) -> str | None:
    """What differs between the server's tokenization of PROBE (vLLM's POST /tokenize) and the
    policy's; a server without the route: the run is refused (nothing to compare)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{root}/tokenize", json={"model": name, "prompt": PROBE,
                                                 "add_special_tokens": False},
                       headers=headers, timeout=30)
    except httpx.HTTPError as e:
        return f"its /tokenize could not be reached ({type(e).__name__}: {e})"
    if r.status_code != 200:
        return f"its /tokenize answered HTTP {r.status_code} (a vLLM server has it)"
    theirs = r.json().get("tokens")
    ours = tokenizer.encode(PROBE, add_special_tokens=False)
    return None if theirs == ours else (f"it encodes the same text as {theirs[:8]}..., the "
                                        f"policy as {ours[:8]}...")


async def load_teachers(cfg: TrainConfig, tokenizer: Any, threads: int) -> dict[str | None, Any]:
    """{policy: its teacher's engine} for every taught policy (`taught_policies`)."""
    out: dict[str | None, Any] = {}
    try:
        for policy, dc in taught_policies(cfg).items():
            out[policy] = await load_teacher(dc, tokenizer, cfg, key=key_of(policy), threads=threads)
    except BaseException:
        await close(out)
        raise
    return out


async def close(teachers: Mapping[str | None, Any]) -> None:
    for engine in teachers.values():
        await engine.aclose()


def taught_roles(cfg: TrainConfig) -> list[str] | None:
    """The roles a (policy's) config's teacher teaches: distill.roles, else those that train."""
    return cfg.distill.roles or cfg.roles.train


def taught_turns(rollout, roles: Iterable[str] | None) -> list[int]:
    """The indices of the rollout's turns the teacher scores: those of `roles` (None: every
    role) that have response tokens."""
    roles = None if roles is None else list(roles)
    return [k for k, t in enumerate(rollout.turns) if t.response_ids and trains(t.role, roles)]


async def teach(teachers: Mapping[str | None, Any], store, results: list,
                cfg: TrainConfig) -> dict[str, float]:
    """Each teacher scores the taught turns of the step's rollouts (`results`, the runner's)
    that it has not scored yet; the scores go to the store (module docstring). Metrics:
    time/teacher_s, teacher/scored_tokens."""
    if not teachers:
        return {}
    t0, n_tokens = time.perf_counter(), 0
    ids = [r.rollout_id for r in results]
    rollouts = store.load_rollouts(rollout_ids=ids)
    for policy, engine in teachers.items():
        roles = taught_roles(cfg if policy is None else cfg.for_policy(policy))
        name = policy or ""
        todo = [r for r in rollouts if not any(
            (e.payload or {}).get("teacher") == name for e in store.list_events(r.rollout_id, EVENT))]
        pairs = [(r, k) for r in todo for k in taught_turns(r, roles)]
        if not pairs:
            continue
        if hasattr(engine, "drop_prefix_cache"):  # a step's scores depend on its rollouts alone:
            engine.drop_prefix_cache()            # a resumed run scores the same numbers
        try:
            scores = await score(engine, [r.turns[k].prompt_ids for r, k in pairs],
                                 [r.turns[k].response_ids for r, k in pairs])
        except ValueError as e:  # (a turn longer than the teacher's context, ...)
            raise ConfigError(f"config key '{key_of(policy)}.teacher': it cannot score the "
                              f"step's turns: {e}") from None
        by_rollout: dict[str, dict[str, list[float]]] = {}
        for (r, k), lps in zip(pairs, scores, strict=True):
            by_rollout.setdefault(r.rollout_id, {})[str(k)] = lps
            n_tokens += len(lps)
        for rid, turns in by_rollout.items():
            await store.add_event(rid, EVENT, {"teacher": name, "turns": turns})
    return {"time/teacher_s": time.perf_counter() - t0, "teacher/scored_tokens": float(n_tokens)}


def teacher_scores(store, rollout_ids: Iterable[str]) -> dict[str, dict[int, list[float]]]:
    """{rollout id: {turn index: the teacher's logprobs}} from the store's "teacher" events
    (every teacher's: several policies teach disjoint roles)."""
    out: dict[str, dict[int, list[float]]] = {}
    for rid in rollout_ids:
        mine = out.setdefault(rid, {})
        for event in store.list_events(rid, EVENT):
            turns = (event.payload or {}).get("turns", {})
            mine.update({int(k): v for k, v in turns.items()})
    return out
