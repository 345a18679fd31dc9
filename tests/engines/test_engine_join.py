"""Continuous batching (engines/join.py): requests that arrive while a batch decodes join it, and
each gets the tokens and logprobs it gets alone."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from joining import with_late_requests
from test_engine_local import LOGPROB_ATOL, teacher_forced_logprobs
from transformers import DynamicCache

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.join import join_rows
from tracetrain.engines.local import LocalEngine
from tracetrain.models.tiny import build_model, build_tokenizer

TOK = build_tokenizer()
# eos made impossible (in the model itself, so the engine's copy and teacher forcing agree): the
# first request decodes its whole max_tokens, long enough for the others to arrive while it runs
MODEL = build_model(TOK, seed=3)
_NO_EOS = torch.zeros(len(TOK))
_NO_EOS[TOK.eos_token_id] = -1e4
MODEL.lm_head.register_forward_hook(lambda m, i, out: out + _NO_EOS)
PROMPTS = [TOK.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
    "input_ids"] for t in ("Guess a number between 1 and 8.", "Higher.", "What is 12 + 30?")]


def _cache(rows: int, length: int, seed: int) -> tuple[DynamicCache, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(rows, 2, length, 4, generator=g),
               torch.randn(rows, 2, length, 4, generator=g)) for _ in range(2)]
    mask = (torch.rand(rows, length, generator=g) < 0.8).long()
    mask[:, -1] = 1
    return DynamicCache(layers), mask


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 3), st.integers(1, 6))
def test_join_rows_right_aligns_both_and_masks_the_padding(B, L, N, Ln):
    (a, ma), (b, mb) = _cache(B, L, 0), _cache(N, Ln, 1)
    keys_a, keys_b = [la.keys.clone() for la in a.layers], [lb.keys.clone() for lb in b.layers]
    cache, mask = join_rows(a, ma, b, mb)
    M = max(L, Ln)
    assert mask.shape == (B + N, M)
    assert mask[:B, M - L :].equal(ma) and mask[B:, M - Ln :].equal(mb)
    assert not mask[:B, : M - L].any() and not mask[B:, : M - Ln].any()
    for layer, ka, kb in zip(cache.layers, keys_a, keys_b, strict=True):
        assert layer.keys.shape == (B + N, 2, M, 4) == layer.values.shape
        assert layer.keys[:B, :, M - L :].equal(ka) and layer.keys[B:, :, M - Ln :].equal(kb)
        assert not layer.keys[:B, :, : M - L].any() and not layer.keys[B:, :, : M - Ln].any()


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 8),
                          st.sampled_from([1.0, 0.9]), st.integers(0, 2**31)),
                min_size=1, max_size=3))
def test_a_request_that_joins_gets_the_tokens_it_gets_alone(late_specs):
    late = [(PROMPTS[p] + [7 + k], SamplingParams(max_tokens=n, top_p=top_p, seed=seed))
            for k, (p, _, n, top_p, seed) in enumerate(late_specs)]
    join_after = [j for _, j, _, _, _ in late_specs]
    first = (PROMPTS[0], SamplingParams(max_tokens=120, seed=5))
    eng = LocalEngine(MODEL, TOK, batch_window_ms=1.0)
    head, gens = with_late_requests(eng, first, late, join_after)
    assert eng.stats["joined"] == len(late) and eng.stats["batches"] == 1
    assert len(head.response_ids) == 120
    alone = LocalEngine(MODEL, TOK)
    for (p, sp), g in zip([first, *late], [head, *gens], strict=True):
        ref = alone.generate_batch([p], sp)[0]
        assert g.response_ids == ref.response_ids
        torch.testing.assert_close(torch.tensor(g.response_logprobs),
                                   torch.tensor(ref.response_logprobs), atol=LOGPROB_ATOL, rtol=0)
        expected = teacher_forced_logprobs(MODEL, p, g.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(g.response_logprobs), expected,
                                   atol=LOGPROB_ATOL, rtol=0)


def test_joining_respects_max_batch_size_and_the_rest_wait_for_the_next_batch():
    late = [(PROMPTS[k % 3] + [9], SamplingParams(max_tokens=4, seed=k)) for k in range(3)]
    eng = LocalEngine(MODEL, TOK, batch_window_ms=1.0, max_batch_size=2)
    head, gens = with_late_requests(eng, (PROMPTS[1], SamplingParams(max_tokens=120, seed=1)),
                                         late, [2, 2, 2])
    assert eng.stats["joined"] >= 1 and eng.stats["max_batch"] == 2
    assert eng.stats["requests"] == 4 and eng.stats["batches"] == 4 - eng.stats["joined"]
    alone = LocalEngine(MODEL, TOK)
    for (p, sp), g in zip(late, gens, strict=True):
        assert g.response_ids == alone.generate_batch([p], sp)[0].response_ids
