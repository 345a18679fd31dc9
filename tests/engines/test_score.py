"""Scoring (engines/score.py): the logprobs a local engine gives tokens it did not sample are a
plain forward pass's, with and without the prefix cache, for full-attention, sliding-window
(gemma3, mistral), MoE (qwen3_moe) and conv (lfm2) families (every family of
tests/support/families.py measured: at most 2.4e-6); the engine's own samples score as it
recorded them (a teacher equal to the policy gives 0); bad input is refused naming the pair; a
server's malformed prompt_logprobs are named.

Tolerance: fp32 (eps 1.2e-7); a logprob is a log-softmax of logits that are sums over hidden 64 of
products, through 2-3 layers, here |logit| < 10: two orders of summation (one forward pass vs a
prefix's KV then the rest, or a decode step by step) differ by at most about
hidden · eps · |logit| · layers ≈ 64 · 1.2e-7 · 10 · 3 ≈ 2.3e-4; TOL is that. Measured: 1.5e-6.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from families import TOK, family_model
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.score import MAX_SCORE_TOKENS, _chunks, parse_prompt_logprobs, score

TOL = 64 * 1.2e-7 * 10 * 3


def forward_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log softmax(logits)[response[j]] at the positions that predict it: one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


def pairs(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts longer than the sliding window (16), two sharing a 12-token head, one of 5; responses
    of 1 to 30 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (20, 33, 20, 5)]
    prompts[2] = prompts[0][:12] + prompts[2][12:]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 1, 30, 12)]
    return prompts, responses


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "mistral", "qwen3_moe", "lfm2"])
@pytest.mark.parametrize("cache", [True, False])
def test_scores_are_a_forward_pass_logprobs(kind, cache):
    """Twice: the second time the prompts' heads come from the prefix cache (when it keeps them)."""
    model = family_model(kind)
    engine = LocalEngine(model, TOK, prefix_cache=cache, threads=1)
    prompts, responses = pairs(1)
    first = asyncio.run(score(engine, prompts, responses))
    hits = engine.stats["prefix_cache_tokens"]
    again = asyncio.run(score(engine, prompts, responses))
    assert (engine.stats["prefix_cache_tokens"] > hits) == (cache and kind != "lfm2")
    assert engine.stats["scored_tokens"] == 2 * sum(map(len, responses))
    for got in (first, again):
        for p, r, s in zip(prompts, responses, got, strict=True):
            assert len(s) == len(r)
            assert max(abs(a - b) for a, b in zip(s, forward_logprobs(model, p, r), strict=True)) < TOL


def test_a_teacher_equal_to_the_policy_scores_its_samples_as_they_were_recorded():
    """The engine samples at temperature 1; the same weights in another engine score each
    sampled token at the logprob the sampler recorded: distillation's term is 0 (within TOL)."""
    model = family_model("llama", eos=True)
    policy = LocalEngine(model, TOK, threads=1, seed=5)
    teacher = LocalEngine(family_model("llama", eos=True), TOK, threads=1)
    prompts, _ = pairs(2)
    gens = policy.generate_batch(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=3))
    scores = asyncio.run(score(teacher, prompts, [g.response_ids for g in gens]))
    worst = max(abs(a - b) for g, s in zip(gens, scores, strict=True)
                for a, b in zip(g.response_logprobs, s, strict=True))
    assert worst < TOL
    other = LocalEngine(family_model("llama", seed=1, eos=True), TOK, threads=1)
    scores = asyncio.run(score(other, prompts, [g.response_ids for g in gens]))
    assert max(abs(a - b) for g, s in zip(gens, scores, strict=True)
               for a, b in zip(g.response_logprobs, s, strict=True)) > 100 * TOL


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.integers(1, 5000))
def test_chunks_keep_order_and_stay_within_the_budget(lengths, budget):
    chunks = _chunks([[0] * n for n in lengths], budget)
    assert [b for c in chunks for b in c] == list(range(len(lengths)))
    for c in chunks:
        assert c and (len(c) == 1 or len(c) * max(lengths[b] for b in c) <= budget)
    assert MAX_SCORE_TOKENS > 0


@pytest.mark.parametrize("prompts, responses, match", [
    ([[1, 2]], [[3], [4]], "1 prompts but 2 responses"),
    ([[1, 2], []], [[3], [4]], "pair 1: a prompt and a response"),
    ([[1, 2]], [[3, 10**6]], "pair 0: token id 1000000"),
    ([[1, -1]], [[3]], "pair 0: token id -1"),
    ([[5] * 200], [[6] * 57], "pair 0: 200 \\+ 57 tokens, more than the scoring model's context of 256"),
])
def test_bad_pairs_are_refused_naming_the_pair(prompts, responses, match):
    engine = LocalEngine(family_model("llama"), TOK, threads=1)
    with pytest.raises(ValueError, match=match):
        asyncio.run(score(engine, prompts, responses))


def test_a_malformed_prompt_logprobs_answer_is_named():
    ids = [5, 6, 7]
    good = {"choices": [{"prompt_logprobs": [None, {"6": {"logprob": -1.5, "rank": 3}},
                                             {"7": {"logprob": -0.25}, "9": {"logprob": -0.1}}]}]}
    assert parse_prompt_logprobs(good, ids, 2) == [-1.5, -0.25]
    with pytest.raises(ValueError, match="no choices\\[0\\].prompt_logprobs"):
        parse_prompt_logprobs({"choices": [{"text": ""}]}, ids, 2)
    with pytest.raises(ValueError, match="has 2 entries for 3 prompt tokens"):
        parse_prompt_logprobs({"choices": [{"prompt_logprobs": [None, {}]}]}, ids, 2)
    bad = {"choices": [{"prompt_logprobs": [None, {"6": {"logprob": -1.5}}, {"9": {"logprob": -1}}]}]}
    with pytest.raises(ValueError, match="prompt_logprobs\\[2\\] has no logprob for token 7"):
        parse_prompt_logprobs(bad, ids, 2)
