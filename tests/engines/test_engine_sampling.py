"""The local engine's sampler (tracetrain/engines/sampling.py): rows at top_p 1 draw exactly as
before top_p was honoured, rows at top_p < 1 never leave their nucleus, and the logprob recorded
is the one the trainer computes (log_softmax(logits / T), before top-p), on the sampler alone
and through the engine on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import tracetrain.engines.decoder as decoder
from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.sampling import sample_tokens, uniform
from tracetrain.learn.logprobs import response_logprobs
from tracetrain.models.tiny import build_model, build_tokenizer


def sample_tokens_before(logits, temperature, top_p, u):
    """The sampler as it was before this change (tracetrain/engines/local.py at 580f14f), verbatim:
    what a request at top_p 1 got then."""
    greedy = temperature == 0
    z = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    if bool((top_p < 1).any()):
        p, order = p.sort(dim=-1, descending=True)
        p = p * ((p.cumsum(-1) - p) < top_p[:, None])
    else:
        order = None
    cdf = p.double().cumsum(-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    y = j if order is None else order.gather(-1, j)
    y = torch.where(greedy, z.argmax(-1), y.squeeze(-1))
    return y, logp.gather(-1, y[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------- the sampler alone
@st.composite
def batches(draw):
    """(logits [B, V], temperature [B], top_p [B], u [B]): rows of every kind in one batch."""
    B, V = draw(st.integers(1, 6)), draw(st.integers(2, 40))
    logits = draw(st.lists(st.floats(-20, 20, width=32), min_size=B * V, max_size=B * V))
    temps = draw(st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.0]), min_size=B, max_size=B))
    top_p = draw(st.lists(st.sampled_from([1.0, 1.0, 0.95, 0.5, 0.1, 1e-6]), min_size=B, max_size=B))
    u = draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=B, max_size=B))
    return (torch.tensor(logits).view(B, V), torch.tensor(temps), torch.tensor(top_p),
            torch.tensor(u, dtype=torch.float64))


@settings(max_examples=200)
@given(batches())
def test_rows_at_top_p_1_draw_exactly_as_before_whatever_the_other_rows(batch):
    """A row at top_p 1 gets the ids and logprobs (bit for bit) the sampler gave before, in a
    batch where every row was at top_p 1; the rows at top_p < 1 beside it change nothing."""
    logits, temperature, top_p, u = batch
    y, lp = sample_tokens(logits, temperature, top_p, u)
    y0, lp0 = sample_tokens_before(logits, temperature, torch.ones_like(top_p), u)
    at_1 = top_p == 1
    assert torch.equal(y[at_1], y0[at_1]) and torch.equal(lp[at_1], lp0[at_1])
    greedy = temperature == 0  # top_p plays no part in a greedy row
    assert torch.equal(y[greedy], y0[greedy]) and torch.equal(lp[greedy], lp0[greedy])
    # and every row draws what it draws alone (a seeded request, whatever its batch)
    for b in range(len(u)):
        yb, lpb = sample_tokens(logits[b : b + 1], temperature[b : b + 1], top_p[b : b + 1], u[b : b + 1])
        assert int(yb) == int(y[b])
        torch.testing.assert_close(lpb[0], lp[b], rtol=0, atol=1e-6)  # one row's log_softmax


@settings(max_examples=200)
@given(batches())
def test_every_draw_lies_in_its_rows_nucleus_and_its_logprob_is_the_full_one(batch):
    """Each row at top_p < 1 draws a token of its own nucleus (the most likely tokens whose mass
    before them, in float64, is < top_p), and records log_softmax(logits / T) of it, not the
    renormalised log q. Nucleus membership is checked with a slack of 1e-9 in mass: the sampler's
    float64 sum over <= 40 float32 probabilities differs from this one by < 40 * 2^-53."""
    logits, temperature, top_p, u = batch
    y, lp = sample_tokens(logits, temperature, top_p, u)
    greedy = temperature == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], -1)
    for b in range(len(u)):
        assert lp[b] == logp[b, y[b]]  # the same float ops: exactly
        if greedy[b] or top_p[b] == 1:
            continue
        p = logp[b].exp().double()  # as the sampler has them
        before = p[p > p[y[b]]].sum()  # mass of the tokens strictly more likely than the draw
        assert before < float(top_p[b]) + 1e-9, (b, float(before), float(top_p[b]))


@settings(max_examples=30)
@given(
    st.lists(st.floats(-5, 5), min_size=2, max_size=12),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([1.0, 0.9, 0.5, 0.1]),
)
@example([0.0] * 6, 0.5, 0.5)  # a nucleus edge exactly at top_p: excluded below, not by luck
def test_sampler_draws_from_the_nucleus_of_the_tempered_softmax(logits, temperature, top_p):
    """Inverse-CDF sampling on a uniform grid of N points hits each token with frequency
    p_v / (nucleus mass) up to 1/N per boundary, and never leaves the nucleus; rows at top_p 1
    in the same batch hit each token with frequency p_v. (A cumulative mass within float32
    rounding of top_p, or tied tokens across the nucleus edge, make the nucleus ambiguous: such
    draws are skipped.)"""
    n = 2000
    z = torch.tensor(logits) / temperature
    probs = torch.log_softmax(z, -1).exp()  # as the sampler computes them
    edges = probs.sort(descending=True).values.cumsum(0)
    assume(bool(((edges - top_p).abs() > 1e-5).all()))
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    # n rows at top_p, then n rows at 1: one batch
    y, lp = sample_tokens(
        torch.tensor([logits] * 2 * n), torch.full((2 * n,), temperature),
        torch.tensor([top_p] * n + [1.0] * n), torch.cat([grid, grid]),
    )
    sp, order = probs.sort(descending=True)
    in_nucleus = (sp.cumsum(0) - sp) < top_p
    k = int(in_nucleus.sum())  # tied tokens across the nucleus edge: which ones are in is sort order
    assume(k == len(sp) or float(sp[k - 1] - sp[k]) > 1e-6)
    nucleus = set(order[in_nucleus].tolist())
    assert set(y[:n].tolist()) <= nucleus
    mass = sp[in_nucleus].sum()
    for rows, share in ((y[:n], {v: probs[v].item() / mass.item() for v in nucleus}),
                        (y[n:], {v: probs[v].item() for v in range(len(logits))})):
        freq = torch.bincount(rows, minlength=len(logits)).double() / n
        for v, f in share.items():
            assert abs(freq[v].item() - f) <= 2 / n + 1e-6
    torch.testing.assert_close(lp, torch.log_softmax(z, -1)[y])


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.tensor([[0.0, 2.0, 1.0, 1.9]] * 4)
    u = torch.tensor([0.0, 0.3, 0.7, 1 - 2**-53], dtype=torch.float64)
    y, lp = sample_tokens(logits, torch.ones(4), torch.full((4,), 1e-6), u)
    assert y.tolist() == [1] * 4
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 1])  # not log 1 = 0


def test_sampler_greedy_rows_take_the_argmax_with_its_untempered_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    y, lp = sample_tokens(
        logits,
        torch.tensor([0.0, 0.0]),
        torch.tensor([1.0, 0.3]),
        torch.tensor([0.99, 0.01], dtype=torch.float64),
    )
    assert y.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


@given(st.integers(0, 2**64 - 1), st.integers(0, 10_000))
def test_uniform_is_in_unit_interval_and_varies_by_step(seed, step):
    a, b = uniform(seed, step), uniform(seed, step + 1)
    assert 0.0 <= a < 1.0 and 0.0 <= b < 1.0
    assert a != b and uniform(seed, step) == a
    assert not math.isnan(a)


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, seed=0).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["Guess a number between 1 and 8.", "Higher.", "What is 12 + 30? Think step by step."]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
        "input_ids"] for t in texts] + [[5]]


def test_requests_at_top_p_1_decode_exactly_as_before(model, tok, prompts, monkeypatch):
    """The same seeded requests (top_p 1; sampled at three temperatures and greedy, in one batch)
    through two fresh engines, one with the sampler as it was: the same ids, logprobs bit for
    bit, and finishes."""
    params = [SamplingParams(max_tokens=16, temperature=t, seed=11 + k)
              for k, t in enumerate([1.0, 0.7, 1.5, 0.0])]
    now = LocalEngine(model, tok).generate_batch(prompts, params)
    monkeypatch.setattr(decoder, "sample_tokens", sample_tokens_before)
    before = LocalEngine(model, tok).generate_batch(prompts, params)
    assert [g.response_ids for g in now] == [g.response_ids for g in before]
    assert [g.response_logprobs for g in now] == [g.response_logprobs for g in before]
    assert [g.finish_reason for g in now] == [g.finish_reason for g in before]
    assert sum(len(g.response_ids) for g in now) > 4 * 8  # the rows did decode


def trainer_view(model, prompt: list[int], response: list[int], temperature: float):
    """What the trainer computes for this turn, laid out as one row (tracetrain/learn/logprobs.py:
    response_logprobs), and the full log-distribution at each response position."""
    ids = torch.tensor([prompt + response])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), pos, len(response),
                                  temperature=temperature)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return lp[0], torch.log_softmax(logits / (temperature or 1.0), -1)


# Engine vs trainer: the same fp32 model, a KV-cached left-padded batch against one forward of the
# row (other matmul shapes, a CPU-dependent reduction order): tests/engines/test_engine_local.py
# derives that each logprob of the tiny model (hidden 32, 2 layers, |logit| < 1.1) moves by
# <~ 2e-5 between the two, every token of the vocabulary alike. A = 1e-4 bounds it with ~5x room
# (measured here: max 9.5e-7 over ATEN_CPU_CAPABILITY default / avx2 / avx512, 1 and 2 threads).
A = 1e-4


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.5), (0.7, 0.9), (1.5, 0.3), (1.0, 0.05)])
def test_engine_draws_from_the_nucleus_and_records_the_trainers_logprob(model, tok, prompts,
                                                                         temperature, top_p):
    """(b) every token the engine draws at top_p < 1 lies in the nucleus of the trainer's
    distribution p at its position; (c) its recorded logprob is the trainer's log p(y) within A,
    and not the renormalised log q(y) = log p(y) - log S, from which it is > 100 A away at most
    positions (so A separates the two kinds).

    The nucleus check allows for the engine's own p^e, with |log p^e - log p| <= A for every token:
    a token v with p_v > p_y e^(2A) has p^e_v > p^e_y, so it is ahead of y in the engine's order,
    and the engine kept y only if the mass ahead of it was < top_p. Hence
        sum_{v: p_v > p_y e^(2A)} p_v  <=  e^A * (mass ahead of y in the engine)  <  e^A * top_p."""
    eng = LocalEngine(model, tok)
    params = [SamplingParams(max_tokens=24, temperature=temperature, top_p=top_p, seed=100 * k + j)
              for j in range(3) for k in range(len(prompts))]
    gens = eng.generate_batch(prompts * 3, params)
    log_s, n = [], 0
    for prompt, gen in zip(prompts * 3, gens, strict=True):
        y = torch.tensor(gen.response_ids)
        lp, logp = trainer_view(model, prompt, gen.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.response_logprobs), lp, atol=A, rtol=0)  # (c)
        p = logp.double().exp()
        for t in range(len(y)):
            ahead = p[t] > p[t, y[t]] * math.exp(2 * A)
            assert p[t][ahead].sum() < top_p * math.exp(A), (t, float(p[t][ahead].sum()))  # (b)
            sp = p[t].sort(descending=True).values
            log_s.append(math.log(float(sp[(sp.cumsum(0) - sp) < top_p].sum())))
            n += 1
    assert n >= 12 * 8
    far = sum(abs(s) > 100 * A for s in log_s)
    assert far > n / 2, (far, n)


def test_the_nucleus_check_sees_a_sampler_that_ignores_top_p(model, tok, prompts):
    """The check above has teeth: the same requests at top_p 1 draw tokens outside the top_p 0.5
    nucleus (about half of them: the tiny untrained model's distribution is nearly flat)."""
    eng = LocalEngine(model, tok)
    gens = eng.generate_batch(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=3))
    outside = 0
    for prompt, gen in zip(prompts, gens, strict=True):
        _, logp = trainer_view(model, prompt, gen.response_ids, 1.0)
        p = logp.double().exp()
        for t, v in enumerate(gen.response_ids):
            outside += bool(p[t][p[t] > p[t, v] * math.exp(2 * A)].sum() >= 0.5 * math.exp(A))
    assert outside >= 5
