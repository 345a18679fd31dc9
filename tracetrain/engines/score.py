"""Scoring: the logprobs a model gives tokens it did not sample (a teacher's view of a turn).

    scores = await score(engine, prompts, responses)
    scores[b][j] = log softmax(logits(prompts[b] + responses[b][:j]))[responses[b][j]]

at temperature 1 (the model's own distribution), one float per response token, no sampling.

- local engine: each prompt prefilled as a decode would be (engines/prefill.py: shared prefixes
  once, the prefix cache's KV reused and kept), whose next-token logits score responses[b][0];
  then one forward pass of responses[b][:-1] over that KV, right-padded, scoring the rest. Rows
  go in chunks of at most MAX_SCORE_TOKENS (rows x the longest response) so that the logits
  [rows, tokens, V] stay bounded. A model the engine prefills `plain` (conv layers) is scored by
  one forward pass over prompt + response, left-padded.
- upstream vLLM: one `POST /v1/completions` per turn, the prompt being prompt + response ids,
  `"prompt_logprobs": 0, "max_tokens": 1`; the answer's `choices[0].prompt_logprobs[p]` is
  {"<id>": {"logprob": ...}} for prompt position p (null at 0). vLLM computes them from the
  raw logits, whatever the server's --logprobs-mode. A server that refuses the key answers an
  EngineError naming it; SGLang is not asked (ValueError naming `prompt_logprobs`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import torch

from tracetrain.models.compute import compute_thread, run_with_threads

MAX_SCORE_TOKENS = 4096  # rows x the longest response of one forward pass (logits [., ., V])


def _check(prompts: Sequence[list[int]], responses: Sequence[list[int]], vocab: int | None,
           max_context: int | None = None) -> None:
    """ValueError naming the pair: unequal counts, an empty prompt or response, more tokens than
    `max_context`, an id that is not an int in [0, vocab) (None: not checked here; the server
    checks)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p or not r:
            raise ValueError(f"pair {b}: a prompt and a response of at least one token each "
                             f"(got {len(p)} and {len(r)})")
        if max_context is not None and len(p) + len(r) > max_context:
            raise ValueError(f"pair {b}: {len(p)} + {len(r)} tokens, more than the scoring "
                             f"model's context of {max_context}")
        for i in (*p, *r):
            if type(i) is not int or vocab is not None and not 0 <= i < vocab:
                raise ValueError(f"pair {b}: token id {i!r} is not an int in [0, {vocab})")


async def score(engine: Any, prompts: Sequence[list[int]],
                responses: Sequence[list[int]]) -> list[list[float]]:
    """[[log p(responses[b][j] | prompts[b] + responses[b][:j])]] under `engine`'s model (module
    docstring): a LocalEngine, an UpstreamEngine (vLLM) or an engine with a `score` method."""
    from tracetrain.engines.local import LocalEngine
    from tracetrain.engines.upstream import UpstreamEngine

    prompts, responses = [list(p) for p in prompts], [list(r) for r in responses]
    if isinstance(engine, LocalEngine):
        _check(prompts, responses, engine.vocab_size, engine.max_context)
        future = compute_thread().submit(_local, engine, prompts, responses)
        return await asyncio.wrap_future(future)
    if isinstance(engine, UpstreamEngine):
        _check(prompts, responses, None)
        return list(await asyncio.gather(*(
            _upstream(engine, p, r) for p, r in zip(prompts, responses, strict=True))))
    if hasattr(engine, "score"):
        return await engine.score(prompts, responses)
    raise ValueError(f"engine {getattr(engine, 'name', engine)!r} cannot score tokens")


# ------------------------------------------------------------------ local


def _local(engine, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """On the compute thread: the weights held still, in the engine's torch threads."""
    with engine._lock:
        return run_with_threads(engine.threads, _local_chunks, engine, prompts, responses)


def _chunks(responses: list[list[int]], budget: int) -> list[list[int]]:
    """Indices of the pairs, in order, cut so that a chunk's rows x longest response <= budget
    (a pair longer than it alone)."""
    out: list[list[int]] = [[]]
    longest = 0
    for b, r in enumerate(responses):
        longest_if = max(longest, len(r))
        if out[-1] and longest_if * (len(out[-1]) + 1) > budget:
            out.append([])
            longest_if = len(r)
        out[-1].append(b)
        longest = longest_if
    return out


@torch.inference_mode()
def _local_chunks(engine, prompts, responses) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in prompts]
    with engine.stats.timing("score_s"):
        for idx in _chunks(responses, MAX_SCORE_TOKENS):
            ps, rs = [prompts[b] for b in idx], [responses[b] for b in idx]
            rows = _whole(engine, ps, rs) if engine.plain else _over_prefill(engine, ps, rs)
            for b, lps in zip(idx, rows, strict=True):
                out[b] = lps
            engine.stats["scored_tokens"] += sum(map(len, rs))
    return out


def _gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids]: logits [..., V] (any float dtype, taken in fp32), ids [...]."""
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _over_prefill(engine, prompts, responses) -> list[list[float]]:
    """The prompts prefilled (prefix cache), then the responses' tokens over their KV."""
    logits, cache, mask, next_pos = engine._prefill(prompts, engine.model_version, None)
    dev = engine.device
    first = _gather(logits, torch.tensor([r[0] for r in responses], device=dev))
    N = max(len(r) for r in responses) - 1
    rows = [[float(v)] for v in first.tolist()]
    if N == 0:
        return rows
    B = len(responses)
    ids = torch.full((B, N), engine.pad_id, dtype=torch.long)
    targets = torch.zeros((B, N), dtype=torch.long)
    tail = torch.zeros((B, N), dtype=torch.long)
    for b, r in enumerate(responses):
        n = len(r) - 1
        ids[b, :n] = torch.tensor(r[:-1])
        targets[b, :n] = torch.tensor(r[1:])
        tail[b, :n] = 1
    position = next_pos[:, None] + torch.arange(N, device=dev)[None, :]
    out = engine.runner(input_ids=ids.to(dev), attention_mask=torch.cat([mask, tail.to(dev)], -1),
                        position_ids=position, past_key_values=cache, use_cache=True)
    engine.stats["forward_calls"] += 1
    lps = _gather(out.logits, targets.to(dev)).tolist()
    for b, r in enumerate(responses):
        rows[b] += lps[b][: len(r) - 1]
    return rows


def _whole(engine, prompts, responses) -> list[list[float]]:
    """One forward pass over prompt + response, left-padded (no prefix cache)."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    W, B, dev = max(map(len, seqs)), len(seqs), engine.device
    ids = torch.full((B, W), engine.pad_id, dtype=torch.long)
    mask = torch.zeros((B, W), dtype=torch.long)
    position = torch.zeros((B, W), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, W - len(s):] = torch.tensor(s)
        mask[b, W - len(s):] = 1
        position[b, W - len(s):] = torch.arange(len(s))
    out = engine.runner(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                        position_ids=position.to(dev), use_cache=False)
    engine.stats["forward_calls"] += 1
    rows = []
    for b, r in enumerate(responses):
        n = len(r)  # logits at W-n-1 .. W-2 predict the response's tokens
        lp = _gather(out.logits[b, W - n - 1 : W - 1], torch.tensor(r, device=dev))
        rows.append(lp.tolist())
    return rows


# ------------------------------------------------------------------ upstream


def parse_prompt_logprobs(payload: Any, ids: list[int], n: int) -> list[float]:
    """The logprobs of the last `n` of `ids` from a completions answer with prompt_logprobs
    (module docstring); ValueError naming the field if malformed."""
    try:
        entries = payload["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the answer has no choices[0].prompt_logprobs (does the server take "
                         "`prompt_logprobs`?)") from None
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ValueError(f"choices[0].prompt_logprobs has {got} entries for {len(ids)} prompt "
                         "tokens")
    out = []
    for p in range(len(ids) - n, len(ids)):
        entry = entries[p]
        value = entry.get(str(ids[p])) if isinstance(entry, dict) else None
        lp = value.get("logprob") if isinstance(value, dict) else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise ValueError(f"choices[0].prompt_logprobs[{p}] has no logprob for token {ids[p]}")
        out.append(float(lp))
    return out


async def _upstream(engine, prompt: list[int], response: list[int]) -> list[float]:
    from tracetrain.engines.upstream import EngineError

    if engine.api != "vllm":
        raise ValueError(f"upstream {engine.name!r} ({engine.api}): scoring asks for "
                         "`prompt_logprobs`, which only a vLLM server is asked for")
    ids = prompt + response
    payload = orjson.dumps({"model": engine.served_model, "prompt": ids, "max_tokens": 1,
                            "temperature": 0.0, "n": 1, "stream": False, "prompt_logprobs": 0})

    async def attempt() -> list[float]:
        answer = await engine.post_json(payload)
        try:
            return parse_prompt_logprobs(answer, ids, len(response))
        except ValueError as e:  # a malformed answer will not get better by asking again
            raise engine._bad_answer(e) from None

    try:  # (PromptTooLong is a ValueError: it passes as it is)
        return (await engine.retried(attempt, " at scoring"))[0]
    except EngineError as e:
        raise EngineError(f"{e} (scoring asks for `prompt_logprobs`)", e.status) from None
