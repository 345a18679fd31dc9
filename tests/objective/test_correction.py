"""Importance corrections (tracetrain/objective/correction.py) and invariant 9 (docs/invariants.md):
by hand; a rollout's correction is the same however it is cut into rows (and so are L and its
gradient); rollout-mean's mass is 1 over the kept rollouts; with equal engine and trainer logprobs
every correction is the identity, the loss bit for bit the uncorrected one; the update's gradient
does not depend on how the step is cut into micro-batches or packs with corrections on.

Tolerance: v and the per-rollout sums are float64 sums of a few dozen terms in another order
(cut into rows differently): they agree to ~1e-15 relative; compared at 1e-12. The loss and
gradients compare as in test_packing.py (float32 reassociation) or exactly where nothing is
reassociated.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_credit import batches, trained_batch
from test_packing import PLAIN, assert_close_grads, merged, shared_batch
from tiny_model import tiny_causal_lm

from tracetrain.config import ConfigError, build_config
from tracetrain.learn.update import ppo_update
from tracetrain.objective.correction import MASKS, WEIGHTS, correct
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.weights import RowWeights, row_scales
from tracetrain.rows.aggregate import aggregate
from tracetrain.types import Rollout, Turn


def close(t: torch.Tensor, want) -> None:
    """float32 v against float64 numbers: 1 ulp of float32 relative."""
    torch.testing.assert_close(t.double(), torch.tensor(want, dtype=torch.float64), rtol=2e-7, atol=0)


def test_each_correction_by_hand():
    # rollout 0 is rows 0 and 1, rollout 1 is row 2; mask: two trained tokens per row
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    index = torch.tensor([0, 0, 1])
    mu = torch.zeros(3, 3)
    lr = [[0.1, -0.3], [0.5, 0.2], [-1.0, 0.05]]  # log pi/mu of each trained token
    pi = torch.zeros(3, 3)
    pi[:, :2] = torch.tensor(lr)
    c = correct(pi, mu, mask, index, weight="token", cap=1.5)
    want = [[math.exp(0.1), math.exp(-0.3)], [1.5, math.exp(0.2)], [math.exp(-1.0), math.exp(0.05)]]
    close(c.is_weights[:, :2], want)
    assert c.metrics["correction/capped_frac"] == pytest.approx(1 / 6)  # exp(0.5) = 1.65 > 1.5
    c = correct(pi, mu, mask, index, weight="rollout", cap=3.0)  # LR_0 = 0.5, LR_1 = -0.95
    close(c.is_weights[:, :2], [[math.exp(0.5)] * 2, [math.exp(0.5)] * 2, [math.exp(-0.95)] * 2])
    assert float(c.is_weights[:, 2].abs().sum()) == 0.0  # untrained tokens carry nothing
    c = correct(pi, mu, mask, index, mask_mode="token", band=(0.5, 1.5))  # exp(-1) and exp(.5) out
    assert c.is_weights[:, :2].tolist() == [[1, 1], [0, 1], [0, 1]]
    assert c.metrics["correction/masked_token_frac"] == pytest.approx(2 / 6)
    assert c.metrics["correction/masked_rollouts"] == 2
    # geometric means: G_0 = 0.5 / 4 = 0.125, G_1 = -0.95 / 2 = -0.475 (exp 0.62)
    c = correct(pi, mu, mask, index, mask_mode="rollout", band=(0.7, 2.0))
    assert c.is_weights[:, :2].tolist() == [[1, 1], [1, 1], [0, 0]]
    c = correct(pi, mu, mask, index, reject=(0.7, 2.0))
    assert c.is_weights is None and c.metrics["correction/rejected_rollouts"] == 1
    assert c.mask.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    # rollout-mean over the kept: rollout 0 alone, mass 1
    s = row_scales(c.mask, index)
    assert float((c.mask * s[:, None]).sum()) == pytest.approx(1.0)
    assert c.metrics["correction/log_ratio_mean"] == pytest.approx(sum(map(sum, lr)) / 6)
    assert c.metrics["correction/abs_log_ratio_max"] == pytest.approx(1.0)


def test_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match="correction.weight.*correction.old: trainer"):
        build_config({}, ["correction.weight=rollout"])
    with pytest.raises(ConfigError, match="correction.band"):
        build_config({}, ["correction.old=trainer", "correction.band=[1.2, 2]"])
    with pytest.raises(ConfigError, match="correction.reject"):
        build_config({}, ["correction.old=trainer", "correction.reject=[0.5]"])
    with pytest.raises(ConfigError, match="correction.cap"):
        build_config({}, ["correction.old=trainer", "correction.cap=0.5"])
    with pytest.raises(ConfigError, match="correction"):
        build_config({}, ["backend=verl", "correction.old=trainer"])


def keyed_logprobs(batch, seed: int, spread: float):
    """pi and mu [rows, R], one value per trained token (rollout, turn, position) wherever the
    token's row is: the same tokens get the same numbers under any cut."""
    g = torch.Generator().manual_seed(seed)
    pi, mu = torch.zeros(batch.response_mask.shape), torch.zeros(batch.response_mask.shape)
    seen: dict[tuple, tuple[float, float]] = {}
    keys = {}
    for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
        for k, start, n in spans:
            for j in range(n):
                key = (rid, k, j)
                if key not in seen:
                    b = -float(torch.rand((), generator=g)) * 2 - 0.01
                    seen[key] = (b + spread * float(torch.randn((), generator=g)), b)
                pi[i, start + j], mu[i, start + j] = seen[key]
                keys[(i, start + j)] = key
    return pi, mu, keys


SETTINGS = [dict(weight="token", cap=2.0), dict(weight="rollout", cap=2.0),
            dict(mask_mode="token", band=(0.7, 1.4)), dict(mask_mode="rollout", band=(0.9, 1.1)),
            dict(weight="rollout", cap=5.0, mask_mode="token", band=(0.5, 2.0), reject=(0.8, 1.25))]


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(SETTINGS), st.sampled_from([0.0, 0.05, 0.4]), st.integers(0, 99))
def test_a_rollouts_correction_is_the_same_for_any_cut_and_so_are_the_loss_and_gradient(
        rollouts, setting, spread, seed):
    """trajectory (a rollout in one row per role) vs transition (one row per turn): each trained
    token gets the same v, the same rollouts are rejected, L and dL/dlogprob are the same, and
    rollout-mean's mass is 1 over the kept rollouts (0 when all are rejected)."""
    out = []
    for level in ("trajectory", "transition"):
        batch = trained_batch(rollouts, ["solver"], level=level)
        if not batch.n_rows:
            return
        pi, mu, keys = keyed_logprobs(batch, seed, spread)
        c = correct(pi, mu, batch.response_mask, batch.rollout_index, **setting)
        v = c.is_weights if c.is_weights is not None else torch.ones_like(pi)
        lp = pi.clone().requires_grad_()
        adv = torch.linspace(-1, 1, batch.n_rollouts)[batch.rollout_index]
        s = row_scales(c.mask, batch.rollout_index)
        loss, m = policy_loss(lp, pi, adv, RowWeights(c.mask, s), is_weights=v)
        loss.backward()
        kept_rollouts = {batch.rollout_ids[i] for i in range(batch.n_rows) if c.mask[i].any()}
        assert float(m["weight_mass"]) == pytest.approx(1.0 if kept_rollouts else 0.0, abs=1e-6)
        per_token = {keys[pos]: (float(v[pos]), float(lp.grad[pos]), bool(c.mask[pos])) for pos in keys}
        out.append((per_token, kept_rollouts, float(loss.detach()), c.metrics))
    (t0, k0, l0, m0), (t1, k1, l1, m1) = out
    assert k0 == k1 and m0["correction/rejected_rollouts"] == m1["correction/rejected_rollouts"]
    assert t0.keys() == t1.keys()
    for key in t0:
        assert t0[key][0] == pytest.approx(t1[key][0], rel=1e-12, abs=1e-300), key  # v
        assert t0[key][2] == t1[key][2]  # kept
        assert t0[key][1] == pytest.approx(t1[key][1], rel=1e-5, abs=1e-8), key  # gradient
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-7)


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(sorted(WEIGHTS)), st.sampled_from(sorted(MASKS)), st.booleans())
def test_with_equal_logprobs_every_correction_is_the_identity(rollouts, weight, mask_mode, reject):
    batch = trained_batch(rollouts, None)
    pi, _, _ = keyed_logprobs(batch, 0, 0.0)
    c = correct(pi, pi.clone(), batch.response_mask, batch.rollout_index, weight=weight,
                mask_mode=mask_mode, band=(0.9, 1.1), reject=(0.99, 1.01) if reject else None)
    assert torch.equal(c.mask, batch.response_mask.bool())
    assert c.metrics["correction/rejected_rollouts"] == 0 and c.metrics["correction/masked_token_frac"] == 0
    adv = torch.linspace(-1, 1, batch.n_rollouts)[batch.rollout_index]
    w = RowWeights(batch.response_mask, row_scales(batch.response_mask, batch.rollout_index))
    old = pi * 0.97  # a ratio that is not 1, so that the surrogate and its clip are at work
    runs = []
    for v in (None, c.is_weights):
        lp = pi.clone().requires_grad_()
        loss, _ = policy_loss(lp, old, adv, w, is_weights=v)
        loss.backward()
        runs.append((loss.detach(), lp.grad))
    if c.is_weights is not None:
        assert torch.equal(c.is_weights[batch.response_mask.bool()],
                           torch.ones(int(batch.response_mask.sum())))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_mixed_version_rollout_is_corrected_with_each_tokens_own_behaviour_logprob():
    """Turns made by versions 0 and 1 (a weight update in the middle of the rollout): each trained
    token's mu is its own turn's recorded logprob, and so is its log ratio."""
    t0 = Turn([1, 2, 3], [10, 11], [-0.5, -0.25], 0)
    t1 = Turn([1, 2, 3, 10, 11, 4], [12, 13, 14], [-1.0, -2.0, -0.125], 1)
    batch, _ = aggregate([Rollout("r", "g", [t0, t1], 1.0)], level="trajectory",
                         max_prompt_length=16, max_response_length=16)
    assert batch.n_rows == 1
    m = batch.response_mask[0]
    assert batch.rollout_logprobs[0][m].tolist() == [-0.5, -0.25, -1.0, -2.0, -0.125]
    pi = torch.zeros_like(batch.rollout_logprobs)
    pi[0, m] = torch.tensor([-0.5, -0.5, -1.0, -1.0, -0.125])
    c = correct(pi, batch.rollout_logprobs, batch.response_mask, batch.rollout_index,
                weight="token", cap=10.0)
    close(c.is_weights[0][m], [1, math.exp(-0.25), 1, math.e, 1])


def corrected_update(batch, adv, correction: dict, **optim):
    """ppo_update's loss and gradients with `correction` on (lr 0: the gradient stays in .grad)."""
    model = tiny_causal_lm(0)
    model.set_attn_implementation("eager")
    cfg = build_config({"optim": {"lr": 1e-3, "warmup_steps": 0, "grad_clip": 1e9, **optim},
                        "correction": correction})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    (res,) = ppo_update(model, opt, batch, adv, cfg)
    return res, [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


CORRECTIONS = [
    {"old": "trainer", "weight": "rollout", "cap": 1e6},
    {"old": "trainer", "weight": "token", "mask": "rollout", "band": [0.2, 5.0]},
    {"old": "trainer", "weight": "rollout", "cap": 1e6, "reject": [0.999, 1.001]},
]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000),
       groups=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3),
       correction=st.sampled_from(CORRECTIONS), spread=st.sampled_from([0.05, 0.3]))
def test_partition_and_split_invariance_of_the_update_with_corrections_on(seed, groups, correction, spread):
    """The corrections are fixed before the step is cut: packs of any size, and a rollout's rows
    merged into one, give the same loss, gradient and correction metrics; rollout-mean's mass
    is 1 over the kept rollouts."""
    batch = shared_batch(seed, groups, common=4, question=2)
    g = torch.Generator().manual_seed(seed)
    batch.rollout_logprobs = (batch.rollout_logprobs
                              - spread * torch.rand(batch.rollout_logprobs.shape, generator=g))
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(seed + 1))
    expected, g_expected = corrected_update(batch, adv, correction, **PLAIN)
    assert expected.correction is not None
    if expected.correction["correction/rejected_rollouts"] == batch.n_rollouts:
        return  # every rollout out: no update at all (checked by hand in the test above)
    for b in (batch, merged(batch)):
        for pack_tokens in (6, 25, 10_000):
            res, grads = corrected_update(b, adv, correction, pack_tokens=pack_tokens, logprob_chunk=4)
            assert res.metrics["weight_mass"] == pytest.approx(1.0, abs=1e-6)
            assert res.metrics["rollout_mass_x_R_min"] == pytest.approx(1.0)
            assert res.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)
            assert_close_grads(grads, g_expected)
            for k, x in expected.correction.items():
                assert res.correction[k] == pytest.approx(x, rel=1e-4, abs=1e-6), k


def test_a_step_whose_rollouts_are_all_rejected_makes_no_update():
    batch = shared_batch(7, [[3, 2], [1, 2]], common=4, question=2)
    batch.rollout_logprobs = batch.rollout_logprobs - 1.0  # every token 2.7x likelier to the trainer
    adv = torch.randn(batch.n_rollouts, generator=torch.Generator().manual_seed(0))
    res, grads = corrected_update(batch, adv, {"old": "trainer", "reject": [0.5, 2.0]})
    assert res.correction["correction/rejected_rollouts"] == batch.n_rollouts
    assert res.loss == 0.0 and all(gr is None or float(gr.abs().max()) == 0.0 for gr in grads)
