"""The pack's attention computed row by row (learn/sparse_pack.py) instead of through the dense
[N, N] tree mask gives the padded computation's logprobs, loss and gradients, with and without
shared prefixes; it computes no more scores than a padded batch; calls without a plan are left
to transformers' own SDPA.

Tolerance: the sparse path computes the same fp32 terms as the padded one, only through matmuls
of other shapes: each attention output is a softmax-weighted sum over at most the row's length of
keys (< 40 here; the padded keys the group adds have weight exactly 0), and each gradient entry a
sum of at most a few hundred products, whose order (one batched SDPA over the rows' blocks vs a
padded rectangle, a shared prefix's K and V gradients added back from each row that read them)
differs. The reassociation error is then <~ 300 u = 2e-5 of the sum of the magnitudes summed
(u = 6e-8, fp32), whatever kernel ATen's CPU dispatch picks (default, avx2, avx512: other
vector widths change the order of the partial sums, not their count) and however many threads
split the batch. Comparing against 1e-4 of the tensor's largest entry plus 1e-6 absolute (entries
that cancel to ~0) is test_packing.py's bound and leaves room; a token attending to a key it
must not (another row's, or a later one) moves the entries by O(1) of their scale. The attention
outputs compared directly below are convex combinations of V entries of magnitude <~ 4 (normal
samples), summed over <= 40 keys: 1e-5 absolute is 40 u x 4 with room.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import PLAIN, assert_close_grads, shared_batch, update_gradients
from tiny_model import tiny_causal_lm

from tracetrain.learn import packing, sparse_pack
from tracetrain.learn.packing import pack_rows, row_logprobs
from tracetrain.learn.sparse_pack import build_plan, pack_attention


@contextlib.contextmanager
def attention(mode: str):
    """packing.PACK_ATTENTION = mode inside; restored after."""
    before = packing.PACK_ATTENTION
    packing.PACK_ATTENTION = mode
    try:
        yield
    finally:
        packing.PACK_ATTENTION = before


@contextlib.contextmanager
def counted(function):
    """[calls]: how many times `function.apply` ran inside."""
    calls, apply = [0], function.apply

    def counting(*args):
        calls[0] += 1
        return apply(*args)

    function.apply = counting
    try:
        yield calls
    finally:
        function.apply = apply


def dense_attention(q, k, v, allowed):
    """The reference: SDPA over the whole pack with the [N, N] tree mask, kv heads repeated."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])


def random_pack(seed, groups, common, question, share, heads, D=8):
    """(batch, its pack, the pack's plan, a generator, random q [1, H, N, D] and k, v
    [1, Hkv, N, D] that require grad) for heads = (H, Hkv)."""
    batch = shared_batch(seed, groups, common=common, question=question)
    pk = pack_rows(batch.input_ids, batch.attention_mask, share=share)
    plan = build_plan(pk.node, pk.n_tokens)
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    qkv = [torch.randn(1, h, pk.n_tokens, D, generator=g).requires_grad_(True) for h in (H, Hkv, Hkv)]
    return batch, pk, plan, g, qkv


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000),
       groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=4),
       common=st.integers(0, 8), question=st.integers(0, 4), share=st.booleans(),
       heads=st.sampled_from([(4, 2), (3, 3), (6, 1)]))
def test_row_blocks_equal_the_dense_tree_mask(seed, groups, common, question, share, heads):
    """pack_attention over random prefix-sharing packs (GQA too) equals SDPA with the pack's
    dense mask, and computes no more scores than the padded batch's attention."""
    batch, pk, plan, g, (q, k, v) = random_pack(seed, groups, common, question, share, heads)
    N = pk.n_tokens
    got = pack_attention(q, k, v, plan)  # [1, N, H, D]
    expected = dense_attention(q, k, v, pk.allowed).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    dy = torch.randn(got.shape, generator=g)  # and the gradients (K and V: summed over the query
    mine = torch.autograd.grad(got, (q, k, v), dy)  # heads they serve, in either layout)
    theirs = torch.autograd.grad(expected, (q, k, v), dy)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * (1 + N))
    lengths = batch.attention_mask.sum(1)
    assert plan.scores <= batch.n_rows * int(lengths.max()) ** 2  # a padded batch's attention scores
    if not share:  # each row's own square, at most
        assert plan.scores <= int((lengths ** 2).sum()) * sparse_pack.SLACK


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000),
       groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=4),
       common=st.integers(0, 8), heads=st.sampled_from([(4, 2), (3, 3), (6, 1)]))
def test_row_blocks_under_autocast_compute_in_fp32(seed, groups, common, heads):
    """Under bf16 autocast the row blocks go through sparse_pack.Fp32Flash: the dense tree
    attention in fp64 on the bf16-rounded operands, to the bf16 rounding of the output (2^-8 of
    it, plus fp32's sums) and of the gradients (their inputs, the kept output and dq, dk, dv
    themselves rounded to bf16: a few 2^-8 of the largest)."""
    _, pk, plan, g, (q, k, v) = random_pack(seed, groups, common, 2, True, heads)
    with torch.autocast("cpu", dtype=torch.bfloat16), counted(sparse_pack.Fp32Flash) as calls:
        got = pack_attention(q, k, v, plan)  # [1, N, H, D]
    assert calls == [len(plan.groups)] and got.dtype == torch.bfloat16
    low = [t.detach().bfloat16().double().requires_grad_(True) for t in (q, k, v)]
    expected = dense_attention(*low, pk.allowed).transpose(1, 2)
    err = float((got.double() - expected).detach().abs().max())
    assert err <= 2.0**-8 * float(expected.detach().abs().max()) + 1e-5
    dy = torch.randn(got.shape, generator=g).bfloat16()
    mine = torch.autograd.grad(got, (q, k, v), dy)
    theirs = torch.autograd.grad(expected, low, dy.double())
    for a, b in zip(mine, theirs, strict=True):
        assert float((a.double() - b).abs().max()) <= 4 * 2.0**-8 * float(b.abs().max()) + 1e-5


def test_plan_of_a_small_tree():
    # rows [a b c x], [a b c y z], [a b d]: the second row adds y z over a b c, the third d over a b
    ids = torch.tensor([[0, 1, 2, 3, 10, 0], [1, 2, 3, 11, 12, 0], [0, 0, 1, 2, 4, 0]])
    att = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    pk = pack_rows(ids, att)
    segs = sparse_pack.row_segments(pk.node, pk.n_tokens)
    assert [(p.tolist(), s) for p, s in segs] == [([0, 1, 2, 3], 0), ([0, 1, 2, 4, 5], 3), ([0, 1, 6], 2)]
    plan = pk.sparse_plan()
    # rows sorted by new tokens: x's row (4 over 4 keys) and y z (2 over 5) padded to 2 x 4 x 5,
    # within 2x their own 16 + 10 scores; d (1 over 3) would make 3 x 4 x 5 > 2 x 29: alone
    assert sorted(g.shape for g in plan.groups) == [(1, 1, 3), (2, 4, 5)]
    assert plan.scores == 40 + 3 < plan.dense_scores == 49
    two, one = sorted(plan.groups, key=lambda g: -g.shape[0])
    assert two.q_idx.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert two.k_idx.tolist() == [0, 1, 2, 3, 0, 0, 1, 2, 4, 5]
    # x (query 3 of its row) sees a b c x, not the padded key; z (query 1) sees a b c y z
    assert two.mask[0, 0, 3].tolist() == [True, True, True, True, False]
    assert two.mask[1, 0, 1].tolist() == [True] * 5
    assert two.mask[1, 0, 0].tolist() == [True, True, True, True, False]  # y: a b c y
    assert two.mask[1, 0, 2].tolist() == [True, False, False, False, False]  # padding: one key
    assert one.mask[0, 0, 0].tolist() == [True] * 3 and one.q_idx.tolist() == [6]
    assert two.keep.tolist() == [0, 1, 2, 3, 4, 5]
    assert pk._allowed is None  # the plan never built the dense mask


def sparse_model(seed: int):
    m = tiny_causal_lm(seed)
    m.set_attn_implementation("sdpa")
    return m


@settings(max_examples=12)
@given(seed=st.integers(0, 10_000),
       groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3),
       common=st.integers(0, 6), question=st.integers(0, 3), share=st.booleans(),
       chunk=st.sampled_from([0, 3, 512]), pack_tokens=st.sampled_from([8, 20, 10_000]),
       mode=st.sampled_from(["rollout-mean", "token-mean"]))
def test_packed_sparse_equals_padded(seed, groups, common, question, share, chunk,
                                     pack_tokens, mode):
    """ppo_update's loss, metrics and gradients (KL to a reference model and the entropy term on)
    with packs attended row by row equal the padded rows' (eager, the plain path)."""
    batch = shared_batch(seed, groups, common=common, question=question)
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(seed))
    plain, g_plain = update_gradients(batch, adv, mode=mode, attn="eager", **PLAIN)
    with attention("sparse"):
        fast, g_fast = update_gradients(batch, adv, mode=mode, attn="sdpa", pack_rows=True,
                                        share_prefixes=share, logprob_chunk=chunk,
                                        pack_tokens=pack_tokens)
    assert fast.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-6)
    for k in ("entropy", "kl", "clip_frac"):
        if k in plain.metrics:
            assert fast.metrics[k] == pytest.approx(plain.metrics[k], rel=1e-4, abs=1e-6)
    assert_close_grads(g_fast, g_plain)


def test_shared_prefixes_sparse_equal_dense_and_padded():
    """One fixed batch of long shared starts (system prompt, questions, earlier turns): the
    logprobs and their gradients of sparse packs, dense packs and padded rows agree, and the
    sparse forward went through the plan once per layer."""
    batch = shared_batch(7, [[3, 2, 1], [2, 2], [1, 3]], common=12, question=4)
    args = (batch.attention_mask, batch.position_ids, batch.response_length, batch.response_mask)
    results = {}
    for name, mode, pack in (("padded", "dense", False), ("dense", "dense", True),
                             ("sparse", "sparse", True)):
        m = sparse_model(0)
        with attention(mode):
            lp, ent, pk = row_logprobs(m, batch.input_ids, *args, pack=pack, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        results[name] = (lp.detach(), [p.grad.clone() for p in m.parameters()], pk)
    pk = results["sparse"][2]
    assert pk._plan is not None and pk._plan.calls == 2  # the tiny model's 2 layers
    assert pk.n_tokens < int(batch.attention_mask.sum()) - 12  # the shared starts computed once
    for name in ("dense", "sparse"):
        torch.testing.assert_close(results[name][0], results["padded"][0], rtol=1e-5, atol=1e-6)
        assert_close_grads(results[name][1], results["padded"][1])


def test_a_token_of_another_row_moves_nothing():
    """Changing a token of one row leaves every other row's logprobs under the sparse
    path, and does move a later trained token of its own row (the test can fail)."""
    batch = shared_batch(11, [[1, 1, 1, 1]], common=4, question=2)
    m = sparse_model(0)
    args = (batch.attention_mask, batch.position_ids, batch.response_length, batch.response_mask)
    with torch.no_grad(), attention("sparse"):
        before, _, _ = row_logprobs(m, batch.input_ids, *args, share=True)
        ids = batch.input_ids.clone()
        i = 1
        real = batch.attention_mask[i].nonzero().squeeze(1)
        col = int(real[len(real) // 2])  # a token in the middle of row i (in its shared start)
        ids[i, col] = ids[i, col] % 63 + 1
        after, _, _ = row_logprobs(m, ids, *args, share=True)
    others = torch.arange(batch.n_rows) != i
    torch.testing.assert_close(after[others], before[others], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[i], before[i])


def test_auto_picks_the_path():
    """auto: row blocks for an SDPA model's pack where they compute at most half the dense
    mask's scores (rows without sharing), the dense mask where they save less (one row) and for
    eager models; `sparse` takes the plan even there, and leaves eager models the dense mask."""
    batch = shared_batch(2, [[3, 3]], common=3, question=1)
    pk = pack_rows(batch.input_ids, batch.attention_mask, share=False)
    assert pk.sparse_plan().scores <= packing.AUTO_SCORES * pk.sparse_plan().dense_scores
    one = pack_rows(batch.input_ids[:1], batch.attention_mask[:1])
    assert one.sparse_plan().scores == one.sparse_plan().dense_scores
    with attention("auto"):
        assert packing.pack_plan(pk, "sdpa") is pk.sparse_plan()
        assert packing.pack_plan(pk, "eager") is None
        assert packing.pack_plan(one, "sdpa") is None
    with attention("dense"):
        assert packing.pack_plan(pk, "sdpa") is None
    with attention("sparse"):
        assert packing.pack_plan(one, "sdpa") is one.sparse_plan()
        assert packing.pack_plan(pk, "eager") is None


def test_calls_without_a_plan_are_transformers_own():
    """With the dispatcher installed, a padded forward (no plan) gives bit for bit the logits it
    gave before: the original SDPA function ran."""
    m = sparse_model(3)
    batch = shared_batch(4, [[2, 1]], common=3, question=2)
    kw = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
          "position_ids": batch.position_ids}
    with torch.no_grad():
        before = m(**kw).logits
        assert sparse_pack.install()
        after = m(**kw).logits
    assert torch.equal(before, after)


class Wrapped(torch.nn.Module):
    """What row_logprobs sees of a DDP-wrapped model: a `.module`, called whole."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_a_wrapped_model_takes_the_plan_through_its_whole_forward():
    """The DDP path (the whole model called, logits_to_keep) hands the plan down to the
    attention calls as well, and gives the unwrapped dense pack's logprobs."""
    batch = shared_batch(5, [[2, 2], [3]], common=6, question=2)
    args = (batch.attention_mask, batch.position_ids, batch.response_length, batch.response_mask)
    with torch.no_grad():
        with attention("dense"):
            expected, _, _ = row_logprobs(sparse_model(0), batch.input_ids, *args)
        with attention("sparse"):
            got, _, pk = row_logprobs(Wrapped(sparse_model(0)), batch.input_ids, *args)
    assert pk._plan is not None and pk._plan.calls == 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
