"""Optimizer-step partitioning: whole rollouts (and groups) per mini-batch, balance, token budgets,
scales computed once per mini-batch, and partition invariance of a real tiny transformer's gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import (
    logprobs_and_entropy,
    make_rows,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_causal_lm,
)

from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import balanced_bins, micro_batches, plan_step
from tracetrain.objective.weights import RowWeights, token_weights

ALL_MODES = [
    "rollout-mean",
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]


def kw(mode):
    return {"norm_length": 16} if mode == "seq-mean-token-sum-norm" else {}


@st.composite
def step_layout(draw):
    rows_per_rollout = draw(st.lists(st.integers(1, 3), min_size=2, max_size=12))
    width = 8
    n = sum(rows_per_rollout)
    mask = draw(
        st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=n, max_size=n)
    )
    rollout_index = torch.repeat_interleave(
        torch.arange(len(rows_per_rollout)), torch.tensor(rows_per_rollout)
    )
    return torch.tensor(mask, dtype=torch.bool), rollout_index


@settings(max_examples=60, deadline=None)
@given(
    step_layout(),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 20)),
    st.sampled_from(ALL_MODES),
)
def test_plan_keeps_rollouts_whole_and_scales_per_mini_batch(layout, k, budget, mode):
    mask, rollout_index = layout
    n_rollouts = int(rollout_index.max()) + 1
    k = min(k, n_rollouts)
    plan = plan_step(
        mask, rollout_index, n_mini_batches=k, micro_batch_tokens=budget, mode=mode, **kw(mode)
    )
    assert len(plan) == k
    seen = torch.cat([mb.rows for mb in plan])
    assert sorted(seen.tolist()) == list(range(mask.shape[0]))  # every row exactly once
    owner = {}
    for b, mb in enumerate(plan):
        for r in rollout_index[mb.rows].tolist():
            assert owner.setdefault(r, b) == b  # a rollout never spans two optimizer updates
        # scales: exactly what the weights of this mini-batch alone are
        sub_mask = mask[mb.rows]
        expected = token_weights(sub_mask, rollout_index[mb.rows], mode=mode, **kw(mode))
        assert torch.equal(sub_mask * mb.row_scales[:, None], expected)
        if mode in ("rollout-mean", "token-mean", "seq-mean-token-mean") and sub_mask.any():
            assert float(expected.sum()) == pytest.approx(1.0, abs=1e-6)
        # micro-batches: partition of the mini-batch, each within the budget unless a single row
        micro_rows = torch.cat([m.rows for m in mb.micro_batches])
        assert torch.equal(micro_rows.sort().values, mb.rows)
        for m in mb.micro_batches:
            t = int(mask[m.rows].sum())
            assert m.n_tokens == t
            if budget is not None and m.rows.numel() > 1:
                assert t <= budget
            pos = torch.searchsorted(mb.rows, m.rows)
            assert torch.equal(m.row_scales, mb.row_scales[pos])


@settings(max_examples=40, deadline=None)
@given(step_layout(), st.integers(1, 3), st.sampled_from(ALL_MODES),
       st.sampled_from([torch.int64, torch.int32, torch.float32, torch.uint8]))
def test_an_integer_or_float_mask_plans_the_same_step_as_the_bool_mask(layout, k, mode, dtype):
    mask, rollout_index = layout
    k = min(k, int(rollout_index.max()) + 1)
    plan = lambda m: plan_step(m, rollout_index, n_mini_batches=k, micro_batch_tokens=6,  # noqa: E731
                               mode=mode, **kw(mode))
    for want, got in zip(plan(mask), plan(mask.to(dtype)), strict=True):
        assert torch.equal(want.rows, got.rows) and torch.equal(want.row_scales, got.row_scales)
        assert [m.rows.tolist() for m in want.micro_batches] == [m.rows.tolist() for m in got.micro_batches]
    bad = mask.to(dtype).clone()
    bad[0, 0] = 2
    with pytest.raises(ValueError, match=r"response_mask\[0, 0\] is 2"):
        plan(bad)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.integers(1, 5))
def test_balanced_bins_are_within_one_item(costs, n_bins):
    bins = balanced_bins(costs, n_bins)
    assert sorted(k for b in bins for k in b) == list(range(len(costs)))
    loads = [sum(costs[k] for k in b) for b in bins]
    assert max(loads) - min(loads) <= max(costs)
    if len(costs) >= n_bins:
        assert all(bins)  # every rank gets rows, even zero-token ones


def test_zero_token_rows_are_still_dealt_to_every_rank():
    assert balanced_bins([0, 0, 0], 3) == [[0], [1], [2]]
    mask = torch.zeros(4, 3, dtype=torch.bool)
    for rank in range(2):
        (mb,) = plan_step(mask, torch.tensor([0, 0, 1, 1]), world_size=2, rank=rank)
        assert mb.micro_batches and float(mb.row_scales.sum()) == 0.0


def test_micro_batches_by_budget():
    assert micro_batches([3, 3, 3, 9, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert micro_batches([3, 3], None) == [[0, 1]]
    assert micro_batches([], 5) == []


def test_whole_groups_when_asked_and_errors():
    mask = torch.ones(6, 2, dtype=torch.bool)
    rollout_index = torch.tensor([0, 0, 1, 2, 3, 4])
    groups = ["g", "g", "g", "h", "h", "k"]
    plan = plan_step(mask, rollout_index, n_mini_batches=2, groups=groups)
    for mb in plan:
        gs = {groups[i] for i in mb.rows.tolist()}
        for g in gs:  # a group's rows are all in this mini-batch
            assert all(i in mb.rows.tolist() for i, x in enumerate(groups) if x == g)
    with pytest.raises(ValueError, match="lie in two groups"):
        plan_step(mask, rollout_index, groups=["g", "h", "h", "h", "h", "k"])
    with pytest.raises(
        ValueError, match="cannot make 4 mini-batches of whole groups from 3 groups"
    ):
        plan_step(mask, rollout_index, n_mini_batches=4, groups=groups)
    with pytest.raises(ValueError, match="fewer than world_size=8"):
        plan_step(mask, rollout_index, world_size=8, rank=0)
    with pytest.raises(ValueError, match="rank"):
        plan_step(mask, rollout_index, world_size=2, rank=2)


def test_shards_cover_the_mini_batch_and_carry_the_world_size_factor():
    rows = make_rows([2, 1, 3, 1, 2], seed=3)
    mask, ri = rows["response_mask"], rows["rollout_index"]
    full = plan_step(mask, ri)[0]
    shards = [plan_step(mask, ri, world_size=3, rank=k)[0] for k in range(3)]
    got = torch.cat([m.rows for s in shards for m in s.micro_batches])
    assert sorted(got.tolist()) == full.rows.tolist()
    for s in shards:
        assert torch.equal(s.row_scales, full.row_scales)  # same scales on every rank
        for m in s.micro_batches:
            assert torch.allclose(m.row_scales, 3 * full.row_scales[m.rows])


def test_micro_batch_losses_sum_to_the_mini_batch_loss():
    g = torch.Generator().manual_seed(0)
    rows = make_rows([1, 3, 2, 2, 1, 4], R=12, seed=1)
    mask, ri = rows["response_mask"], rows["rollout_index"]
    lp = -torch.rand(mask.shape, generator=g) * 3
    old = lp + 0.3 * torch.randn(mask.shape, generator=g)
    ref = lp + 0.3 * torch.randn(mask.shape, generator=g)
    ent = torch.rand(mask.shape, generator=g)
    adv = torch.randn(int(ri.max()) + 1, generator=g)[ri]
    opts = {"ref_logprobs": ref, "kl_coef": 0.1, "entropy": ent, "entropy_coef": 0.01}
    for mode in ALL_MODES:
        mb = plan_step(mask, ri, mode=mode, **kw(mode))[0]
        whole, _ = policy_loss(lp, old, adv, RowWeights(mask, mb.row_scales), **opts)
        for budget in (1, 5, 17, 40):
            (mb_b,) = plan_step(mask, ri, micro_batch_tokens=budget, mode=mode, **kw(mode))
            total = sum(
                policy_loss(
                    lp[m.rows],
                    old[m.rows],
                    adv[m.rows],
                    RowWeights(mask[m.rows], m.row_scales),
                    ref_logprobs=ref[m.rows],
                    kl_coef=0.1,
                    entropy=ent[m.rows],
                    entropy_coef=0.01,
                )[0]
                for m in mb_b.micro_batches
            )
            assert len(mb_b.micro_batches) > 1
            # each micro-batch's sum is exact to a few u of its terms, then <= 40 of them add up
            # in fp32: <~ 50 u = 3e-6 relative at worst; rel 1e-5 holds on any CPU
            assert float(total) == pytest.approx(float(whole), rel=1e-5, abs=1e-7), (mode, budget)


def grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def run_micro_batches(model, rows, micro, adv, old, ref):
    """Forward + backward every micro-batch with its own row scales; gradients accumulate."""
    model.zero_grad()
    for m in micro:
        lp, ent = logprobs_and_entropy(model, rows, m.rows)
        loss, _ = policy_loss(
            lp,
            old[m.rows],
            adv[m.rows],
            RowWeights(rows["response_mask"][m.rows], m.row_scales),
            ref_logprobs=ref[m.rows],
            kl_coef=0.05,
            entropy=ent,
            entropy_coef=0.01,
        )
        loss.backward()
    return grads_of(model)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_partition_invariance_tiny_transformer(mode):
    rows = make_rows([1, 3, 2, 1, 2, 3, 1], seed=7)
    model = tiny_causal_lm(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lp0, _ = logprobs_and_entropy(model, rows)
    old = lp0 + 0.2 * torch.randn(lp0.shape, generator=g)  # ratios away from 1: clipping happens
    ref = lp0 + 0.2 * torch.randn(lp0.shape, generator=g)
    ri = rows["rollout_index"]
    adv = torch.randn(int(ri.max()) + 1, generator=g)[ri]
    mask = rows["response_mask"]
    (full,) = plan_step(mask, ri, mode=mode, **kw(mode))
    assert len(full.micro_batches) == 1
    expected = run_micro_batches(model, rows, full.micro_batches, adv, old, ref)
    assert any(e.abs().sum() > 0 for e in expected)
    for budget in (1, 4, 9, 20):
        (mb,) = plan_step(mask, ri, micro_batch_tokens=budget, mode=mode, **kw(mode))
        assert len(mb.micro_batches) > 1
        got = run_micro_batches(model, rows, mb.micro_batches, adv, old, ref)
        # Parameter gradients: the same per-token terms, but matmuls over other batch shapes (a
        # CPU-dependent reduction order, K <= 64 terms per dot in this model) and up to 20
        # micro-batch gradients accumulated in fp32: <~ (64 + 20) u ~ 5e-6 relative per entry,
        # so rtol 1e-4 has 20x room; atol 1e-6 covers entries that cancel to ~0.
        for e, a in zip(expected, got, strict=True):
            assert torch.allclose(a, e, rtol=1e-4, atol=1e-6), (mode, budget)
