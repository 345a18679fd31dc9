"""The update's faster paths give today's update: the head's written-out gradient
(packing.USE_HEAD_FUNCTION, learn/head.py) and a pack's grouped-query attention without K/V copies
(sparse_pack.FOLD_GQA), its attention in fp32 on autocast's bf16 operands (sparse_pack.Fp32Flash,
WIDE_ATTENTION) against autograd through checkpointed chunks, transformers' repeat_kv and SDPA's
bf16 kernel under autocast:
the loss, every gradient and the weights after one optimizer step, on packed rows that share
prefixes (a tiny Qwen2 with 4 query heads over 2 kv heads, SDPA), in fp32 and bf16-mixed.

Tolerances, from the arithmetic: in fp32 the two paths compute the same formulas with sums split
or ordered differently, each within (terms x 2^-24) of its terms' magnitude (of the order of the
largest gradient of the model, whatever the gradient's own size where its terms cancel): 1e-4 of
that covers the thousand-odd terms of these sums (as test_packing.py's packed-against-padded
check). Under bf16 autocast each side rounds the head's dz and the attention's operands and
output to bf16 (2^-8), and autograd's head adds its chunks' weight gradients in bf16 where learn/head.py adds
them in fp32: within (chunks + 2) bf16 roundings of the largest gradient (chunks of 7 tokens).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from families import family_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import shared_batch
from tiny_model import tiny_causal_lm

from tracetrain.config import build_config
from tracetrain.learn import packing, sparse_pack
from tracetrain.learn.optim import clip_grad_norm
from tracetrain.learn.update import ppo_update


@contextlib.contextmanager
def paths(fast: bool):
    """The fast paths on or off; a pack's attention in row blocks (where FOLD_GQA and
    WIDE_ATTENTION apply)."""
    flags = "USE_HEAD_FUNCTION", "FOLD_GQA", "WIDE_ATTENTION"
    owners = packing, sparse_pack, sparse_pack
    before = [getattr(m, f) for m, f in zip(owners, flags, strict=True)], packing.PACK_ATTENTION
    for m, f in zip(owners, flags, strict=True):
        setattr(m, f, fast)
    packing.PACK_ATTENTION = "sparse"
    try:
        yield
    finally:
        for m, f, v in zip(owners, flags, before[0], strict=True):
            setattr(m, f, v)
        packing.PACK_ATTENTION = before[1]


def one_update(batch, adv, precision: str, fast: bool, make=tiny_causal_lm):
    """(loss, gradients, weights after one SGD step) of ppo_update on `batch`, `make(0)`'s model."""
    model = make(0)
    model.set_attn_implementation("sdpa")
    cfg = build_config({"optim": {"lr": 0.1, "warmup_steps": 0, "grad_clip": 1e9, "logprob_chunk": 7},
                        "trainer": {"precision": precision}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    opt.register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in model.parameters()))
    with paths(fast):
        (res,) = ppo_update(model, opt, batch, adv, cfg)
    return res.loss, grads, [p.detach().clone() for p in model.parameters()]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000),
       groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3),
       common=st.integers(0, 6), precision=st.sampled_from(["fp32", "bf16-mixed"]))
def test_the_fast_paths_give_todays_update(seed, groups, common, precision):
    batch = shared_batch(seed, groups, common=common, question=2)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(seed))
    check(batch, adv, precision, tiny_causal_lm)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma3_text", "mistral"])
def test_the_fast_paths_give_todays_update_in_each_family(kind):
    """The same across the families' layouts: GQA with head_dim apart from hidden / heads, a MoE,
    sliding windows (padded rows: the head's path alone)."""
    batch = shared_batch(3, [[1, 2], [2, 1], [3]], common=5, question=2)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(3))
    check(batch, adv, "fp32", lambda seed: family_model(kind, seed))


def check(batch, adv, precision, make):
    loss, grads, weights = one_update(batch, adv, precision, True, make)
    loss0, grads0, weights0 = one_update(batch, adv, precision, False, make)
    chunks = -(-int(batch.response_mask.sum()) // 7)
    rel = 1e-4 if precision == "fp32" else (chunks + 2) * 2.0**-8
    assert abs(loss - loss0) <= rel * abs(loss0) + 1e-6
    # a tensor's gradient sums terms that cancel (a bias's over tokens): its error is bounded by
    # the terms' magnitude, the scale of the upstream gradients, not by its own size: the largest
    scale = max(float(g0.abs().max()) for g0 in grads0)
    for g, g0, w, w0 in zip(grads, grads0, weights, weights0, strict=True):
        tol = rel * scale + 1e-6
        assert float((g - g0).abs().max()) <= tol
        assert float((w - w0).abs().max()) <= 0.1 * tol + 2.0**-24 * float(w0.abs().max())


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), max_norm=st.floats(0.01, 100.0), scale=st.floats(0.0, 3.0))
def test_clip_grad_norm_is_torchs_bit_for_bit(seed, max_norm, scale):
    """optim.clip_grad_norm skips the pass where torch's factor is 1: the same norm and
    gradients as torch.nn.utils.clip_grad_norm_, clipped or not."""
    g = torch.Generator().manual_seed(seed)
    ours = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, generator=g)) for n in (3, 17, 64))
    for p in ours:
        p.grad = torch.randn(p.shape, generator=g) * scale
    torchs = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone()) for p in ours)
    for a, b in zip(torchs, ours, strict=True):
        a.grad = b.grad.clone()
    norm = clip_grad_norm(ours, max_norm)
    assert norm == float(torch.nn.utils.clip_grad_norm_(torchs.parameters(), max_norm))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, torchs, strict=True))
