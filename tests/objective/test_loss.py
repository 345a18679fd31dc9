"""Token weights (every mode, the seed cases, mass, split invariance) and the PPO policy loss
(against a slow autograd reference written here, and against numbers worked out by hand)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetrain.objective.loss import KL_ESTIMATORS, policy_loss
from tracetrain.objective.weights import MODES, RowWeights, rollout_mass, row_scales, token_weights

MEAN_MODES = ["rollout-mean", "token-mean", "seq-mean-token-mean"]
ALL_MODES = [*MEAN_MODES, "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def kw(mode):
    return {"norm_length": 8} if mode == "seq-mean-token-sum-norm" else {}


def masses(w: torch.Tensor, rollout_ids) -> dict:
    """Total weight per rollout, summed in Python."""
    out: dict = {}
    for i, r in enumerate(rollout_ids):
        out[r] = out.get(r, 0.0) + float(w[i].sum())
    return out


def reference_weights(mask, rollout_ids, mode, norm_length=None):
    """docs/invariants.md weight table read literally, in exact fractions. Empty rows / rollouts
    carry no weight and are not counted in R or B."""
    rows = mask.tolist()
    t_row = [sum(r) for r in rows]
    t_rollout: dict = {}
    for i, r in enumerate(rollout_ids):
        t_rollout[r] = t_rollout.get(r, 0) + t_row[i]
    n_r = sum(1 for t in t_rollout.values() if t > 0)
    n_b = sum(1 for t in t_row if t > 0)
    total = sum(t_row)
    out = []
    for i, row in enumerate(rows):
        line = []
        for m in row:
            if not m:
                line.append(Fraction(0))
            elif mode == "rollout-mean":
                line.append(Fraction(1, n_r * t_rollout[rollout_ids[i]]))
            elif mode == "token-mean":
                line.append(Fraction(1, total))
            elif mode == "seq-mean-token-mean":
                line.append(Fraction(1, n_b * t_row[i]))
            elif mode == "seq-mean-token-sum":
                line.append(Fraction(1, n_b))
            else:
                line.append(Fraction(1, n_b) / Fraction(norm_length))
        out.append(line)
    return torch.tensor([[float(x) for x in line] for line in out], dtype=torch.float64)


# --- the seed cases ---------------------------------------------------------------------------


def test_two_rollouts_in_two_rows_weigh_one_half_each():
    mask = torch.ones(2, 4, dtype=torch.bool)
    w = token_weights(mask, ["A", "B"])
    assert masses(w, ["A", "B"]) == pytest.approx({"A": 0.5, "B": 0.5})


def test_two_rollouts_in_three_rows_still_weigh_one_half_each():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    ids = ["A", "A", "B"]
    w = token_weights(mask, ids)
    m = masses(w, ids)
    # the peer's divisor (rollout tokens x rows) gives 1/3 and 1/3, total 2/3
    assert m == pytest.approx({"A": 0.5, "B": 0.5})
    assert float(w.sum()) == pytest.approx(1.0)
    # A's 6 tokens share 1/2: 1/12 each; B's 3 tokens share 1/2: 1/6 each
    assert w[0, 0].item() == pytest.approx(1 / 12) and w[1, 3].item() == pytest.approx(1 / 12)
    assert w[2, 0].item() == pytest.approx(1 / 6) and w[2, 3].item() == 0.0


def test_AAAB_on_ones_4x3():
    ids = ["A", "A", "A", "B"]
    w = token_weights(torch.ones(4, 3, dtype=torch.bool), ids)
    assert masses(w, ids) == pytest.approx({"A": 0.5, "B": 0.5})  # the peer: 1/4 and 1/4
    assert torch.allclose(w[:3], torch.full((3, 3), 1 / 18))
    assert torch.allclose(w[3], torch.full((3,), 1 / 6))


# Rows of A have lengths 3, 1, 2 (first k_A of them), rows of B 2, 3, 1 (first k_B).
# Masses (A, B) worked out by hand from the formulas.
A_LENS, B_LENS = [3, 1, 2], [2, 3, 1]
REGRESSION = [
    # k_A, k_B, rollout-mean, seq-mean-token-mean (k/B), token-mean (T_A/T)
    (1, 1, (1 / 2, 1 / 2), (1 / 2, 1 / 2), (3 / 5, 2 / 5)),
    (1, 2, (1 / 2, 1 / 2), (1 / 3, 2 / 3), (3 / 8, 5 / 8)),
    (1, 3, (1 / 2, 1 / 2), (1 / 4, 3 / 4), (3 / 9, 6 / 9)),
    (2, 1, (1 / 2, 1 / 2), (2 / 3, 1 / 3), (4 / 6, 2 / 6)),
    (2, 2, (1 / 2, 1 / 2), (2 / 4, 2 / 4), (4 / 9, 5 / 9)),
    (2, 3, (1 / 2, 1 / 2), (2 / 5, 3 / 5), (4 / 10, 6 / 10)),
    (3, 1, (1 / 2, 1 / 2), (3 / 4, 1 / 4), (6 / 8, 2 / 8)),
    (3, 2, (1 / 2, 1 / 2), (3 / 5, 2 / 5), (6 / 11, 5 / 11)),
    (3, 3, (1 / 2, 1 / 2), (3 / 6, 3 / 6), (6 / 12, 6 / 12)),
]


@pytest.mark.parametrize("k_a,k_b,rollout_mean,seq_mean,token_mean", REGRESSION)
def test_regression_table_one_to_three_rows_per_rollout(
    k_a, k_b, rollout_mean, seq_mean, token_mean
):
    lens = A_LENS[:k_a] + B_LENS[:k_b]
    ids = ["A"] * k_a + ["B"] * k_b
    mask = torch.tensor([[t < n for t in range(4)] for n in lens])
    for mode, expected in [
        ("rollout-mean", rollout_mean),
        ("seq-mean-token-mean", seq_mean),
        ("token-mean", token_mean),
    ]:
        m = masses(token_weights(mask, ids, mode=mode), ids)
        assert (m["A"], m["B"]) == pytest.approx(expected), mode
        assert m["A"] + m["B"] == pytest.approx(1.0)


# --- every mode against the literal reference -----------------------------------------------

rows_strategy = st.integers(1, 7).flatmap(
    lambda n: st.tuples(
        st.lists(st.lists(st.booleans(), min_size=9, max_size=9), min_size=n, max_size=n),
        st.lists(st.sampled_from("ABCD"), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(rows_strategy)
def test_every_mode_matches_the_literal_formula(data):
    mask_l, ids = data
    mask = torch.tensor(mask_l, dtype=torch.bool)
    for mode in ALL_MODES:
        w = token_weights(mask, ids, mode=mode, **kw(mode))
        ref = reference_weights(mask, ids, mode, **kw(mode))
        assert torch.allclose(w.double(), ref, rtol=1e-6, atol=1e-9), mode
        # an int tensor of rollout indices gives the same weights as the str ids
        idx = torch.tensor([ord(c) for c in ids])
        assert torch.equal(token_weights(mask, idx, mode=mode, **kw(mode)), w)


@settings(max_examples=60, deadline=None)
@given(rows_strategy)
def test_mass_is_one_for_every_mean_mode(data):
    mask_l, ids = data
    mask = torch.tensor(mask_l, dtype=torch.bool)
    expected = 1.0 if mask.any() else 0.0
    for mode in MEAN_MODES:
        w = token_weights(mask, ids, mode=mode)
        assert float(w.sum()) == pytest.approx(expected, abs=1e-6), mode
        assert torch.isfinite(w).all()
    # the sum modes: mass = mean over non-empty rows of T_i (divided by L_norm)
    t = [sum(r) for r in mask_l if sum(r) > 0]
    mean_t = sum(t) / len(t) if t else 0.0
    assert float(token_weights(mask, ids, mode="seq-mean-token-sum").sum()) == pytest.approx(mean_t)
    w = token_weights(mask, ids, mode="seq-mean-token-sum-norm", norm_length=8)
    assert float(w.sum()) == pytest.approx(mean_t / 8)


def test_empty_rows_and_rollouts_get_no_weight_and_no_nan():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    ids = ["A", "A", "B", "C"]  # B has no trained token: R = 2 (A, C), B = 2 non-empty rows
    for mode in ALL_MODES:
        s = row_scales(mask, ids, mode=mode, **kw(mode))
        assert torch.isfinite(s).all() and s[1] == 0 and s[2] == 0, mode
    m = masses(token_weights(mask, ids), ids)
    assert m == pytest.approx({"A": 0.5, "B": 0.0, "C": 0.5})
    nothing = torch.zeros(3, 5, dtype=torch.bool)
    for mode in ALL_MODES:
        w = token_weights(nothing, ["A", "B", "B"], mode=mode, **kw(mode))
        assert torch.equal(w, torch.zeros(3, 5)), mode
    assert row_scales(torch.zeros(0, 4, dtype=torch.bool), []).shape == (0,)


def test_rows_of_a_rollout_need_not_be_adjacent():
    mask = torch.ones(4, 3, dtype=torch.bool)
    m = masses(token_weights(mask, ["A", "B", "A", "A"]), ["A", "B", "A", "A"])
    assert m == pytest.approx({"A": 0.5, "B": 0.5})


def test_alias_and_errors():
    mask = torch.ones(3, 2, dtype=torch.bool)
    ids = ["A", "A", "B"]
    assert torch.equal(row_scales(mask, ids, mode="per_rollout_mean"), row_scales(mask, ids))
    with pytest.raises(
        ValueError, match="unknown loss aggregation mode 'mean'.*rollout-mean.*token-mean"
    ):
        row_scales(mask, ids, mode="mean")
    with pytest.raises(ValueError, match="norm_length"):
        row_scales(mask, ids, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_length"):
        row_scales(mask, ids, mode="seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(ValueError, match="norm_length is only used"):
        row_scales(mask, ids, mode="token-mean", norm_length=4)
    with pytest.raises(ValueError, match="response_mask must be a 2-D tensor"):
        row_scales(mask[0], ids)
    with pytest.raises(ValueError, match="rollout_ids has 2 entries but the mask has 3 rows"):
        row_scales(mask, ["A", "B"])
    with pytest.raises(ValueError, match="must all be str, found 7"):
        row_scales(mask, ["A", 7, "B"])
    with pytest.raises(ValueError, match="1-D int64"):
        row_scales(mask, torch.tensor([0.0, 0.0, 1.0]))
    assert set(MODES) == {*ALL_MODES}


# --- masks as users have them: bool, or 0/1 in an integer or float tensor -----------------------

MASK_DTYPES = [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.float64,
               torch.bfloat16]


@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_a_0_1_mask_of_any_dtype_gives_the_bool_masks_weights(dtype):
    """verl's and Agent Lightning's masks are int64; the seed's reproduction is ones(4, 3, long)."""
    ids = ["A", "A", "A", "B"]
    ones = torch.ones(4, 3, dtype=dtype)
    assert masses(token_weights(ones, ids), ids) == pytest.approx({"A": 0.5, "B": 0.5})
    g = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(6, 5, generator=g) < 0.6
    ids = ["A", "B", "A", "C", "B", "C"]
    mask = bool_mask.to(dtype)
    for mode in ALL_MODES:
        assert torch.equal(row_scales(mask, ids, mode=mode, **kw(mode)),
                           row_scales(bool_mask, ids, mode=mode, **kw(mode))), mode
        assert torch.equal(token_weights(mask, ids, mode=mode, **kw(mode)),
                           token_weights(bool_mask, ids, mode=mode, **kw(mode))), mode
    assert torch.equal(rollout_mass(mask, ids, row_scales(bool_mask, ids)),
                       rollout_mass(bool_mask, ids, row_scales(bool_mask, ids)))
    lp = -torch.rand(6, 5, generator=g)
    old, adv = lp + 0.1, torch.randn(6, generator=g)
    scales = row_scales(bool_mask, ids)
    got, _ = policy_loss(lp, old, adv, RowWeights(mask, scales))
    want, _ = policy_loss(lp, old, adv, RowWeights(bool_mask, scales))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype, value, shown", [
    (torch.int64, 2, "2"), (torch.int32, -1, "-1"), (torch.float32, 0.5, "0.5"),
    (torch.float64, float("nan"), "nan"), (torch.uint8, 255, "255"),
])
def test_a_mask_value_other_than_0_or_1_is_named(dtype, value, shown):
    mask = torch.ones(4, 3, dtype=dtype)
    mask[2, 1] = value
    for call in (lambda: row_scales(mask, ["A", "A", "A", "B"]),
                 lambda: token_weights(mask, ["A", "A", "A", "B"]),
                 lambda: policy_loss(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4),
                                     RowWeights(mask, torch.ones(4)))):
        with pytest.raises(ValueError, match=rf"mask\[2, 1\] is {shown}: a mask holds only 0 and 1"):
            call()


def test_a_complex_or_3_d_mask_is_refused():
    with pytest.raises(ValueError, match="2-D tensor"):
        row_scales(torch.ones(2, 3, dtype=torch.complex64), ["A", "B"])
    with pytest.raises(ValueError, match=r"shape \(2, 3, 1\)"):
        row_scales(torch.ones(2, 3, 1, dtype=torch.long), ["A", "B"])


# --- policy loss against a slow reference and hand-computed numbers ----------------------------


def reference_loss(
    lp,
    old,
    adv,
    w,
    *,
    isw=None,
    ref=None,
    kl_coef=0.0,
    kl="k3",
    ent=None,
    ent_coef=0.0,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=3.0,
):
    """verl's formulation, written term by term with autograd."""
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    if isw is not None:
        pg = pg * isw
    loss = (pg * w).sum()
    if ref is not None:
        if kl == "k1":
            k = lp - ref
        elif kl == "k2":
            k = 0.5 * (lp - ref) ** 2
        else:
            x = torch.clamp(ref - lp, -20, 20)
            k = torch.clamp(torch.exp(x) - x - 1, -10, 10)
        loss = loss + kl_coef * (k * w).sum()
    if ent is not None:
        loss = loss - ent_coef * (ent * w).sum()
    return loss


def random_inputs(seed, rows=13, width=29):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.7
    ids = torch.randint(0, 5, (rows,), generator=g)
    lp = torch.randn(rows, width, generator=g) * 0.5 - 1
    old = lp + torch.randn(rows, width, generator=g) * 0.4
    adv_row = torch.randn(rows, generator=g)
    adv_row[0] = 0.0
    return {
        "mask": mask,
        "ids": ids,
        "lp": lp,
        "old": old,
        "adv_row": adv_row,
        "isw": torch.rand(rows, width, generator=g) * 2,
        "ref": lp + torch.randn(rows, width, generator=g) * 1.5,
        "ent": torch.rand(rows, width, generator=g) * 3,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kl", sorted(KL_ESTIMATORS))
@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_policy_loss_matches_reference(seed, kl, dual_clip):
    x = random_inputs(seed)
    s = row_scales(x["mask"], x["ids"])
    w = x["mask"] * s[:, None]
    adv_tok = x["adv_row"][:, None].expand_as(w).contiguous()
    opts = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": dual_clip}
    for isw in (None, x["isw"]):
        lp0 = x["lp"].clone().requires_grad_()
        ent0 = x["ent"].clone().requires_grad_()
        ref_loss = reference_loss(
            lp0,
            x["old"],
            adv_tok,
            w,
            isw=isw,
            ref=x["ref"],
            kl_coef=0.3,
            kl=kl,
            ent=ent0,
            ent_coef=0.05,
            **opts,
        )
        g_lp, g_ent = torch.autograd.grad(ref_loss, [lp0, ent0])
        for weights in (w, RowWeights(x["mask"], s)):
            for adv in (x["adv_row"], adv_tok):
                lp1 = x["lp"].clone().requires_grad_()
                ent1 = x["ent"].clone().requires_grad_()
                loss, metrics = policy_loss(
                    lp1,
                    x["old"],
                    adv,
                    weights,
                    is_weights=isw,
                    ref_logprobs=x["ref"],
                    kl_coef=0.3,
                    kl_estimator=kl,
                    entropy=ent1,
                    entropy_coef=0.05,
                    chunk_tokens=64,
                    **opts,  # several blocks of a few rows
                )
                h_lp, h_ent = torch.autograd.grad(loss, [lp1, ent1])
                # The same fp32 formulas summed in another order over <= a few hundred tokens:
                # a few u (6e-8) of sum |w l| per sum; rel 1e-5 (~170 u) has room on any CPU.
                assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
                assert torch.allclose(h_lp, g_lp, rtol=1e-5, atol=1e-8)
                assert torch.allclose(h_ent, g_ent, rtol=1e-5, atol=1e-8)
                assert metrics["weight_mass"].item() == pytest.approx(1.0, abs=1e-6)


def test_policy_loss_by_hand():
    # One token per row, weight 1 each; clip 0.2, dual clip 3.
    #  row  A    ratio  surrogate                         d/dlogprob
    #  0   +1    1.5    -min(1.5, 1.2)        = -1.2      0 (clipped above)
    #  1   +1    0.5    -0.5                  = -0.5      -0.5
    #  2   -1    2.0    min(max(2, .8), 3)    = 2.0       2.0
    #  3   -1    0.5    max(0.5, 0.8)         = 0.8       0 (clipped below)
    #  4   -1    4.0    min(4, 3)             = 3.0       0 (dual clip)
    #  5   -2    1.0    2 * 1                 = 2.0       2.0
    ratio = torch.tensor([[1.5], [0.5], [2.0], [0.5], [4.0], [1.0]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -2.0])
    old = torch.full((6, 1), -2.0)
    lp = (old + ratio.log()).requires_grad_()
    w = torch.ones(6, 1)
    loss, m = policy_loss(lp, old, adv, w)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 2.0 + 0.8 + 3.0 + 2.0, rel=1e-6)
    assert lp.grad.squeeze(1).tolist() == pytest.approx([0, -0.5, 2.0, 0, 0, 2.0], rel=1e-5)
    assert m["clip_frac"].item() == pytest.approx(3 / 6)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 6)
    assert m["weight_mass"].item() == 6.0
    # approx_kl = mean of (r - 1) - log r
    ak = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 2.0, 0.5, 4.0, 1.0]) / 6
    assert m["approx_kl"].item() == pytest.approx(ak, rel=1e-5)


def test_kl_estimators_by_hand():
    # logprob -1, reference -2: k1 = 1, k2 = 1/2, k3 = e^-1 - (-1) - 1 = e^-1
    # d/dlogprob: k1 1, k2 (lp - ref) = 1, k3 1 - e^-1
    for kl, value, grad in [
        ("k1", 1.0, 1.0),
        ("k2", 0.5, 1.0),
        ("k3", math.exp(-1), 1 - math.exp(-1)),
    ]:
        lp = torch.full((1, 1), -1.0, requires_grad=True)
        old = lp.detach().clone()
        loss, m = policy_loss(
            lp,
            old,
            torch.zeros(1),
            torch.ones(1, 1),
            ref_logprobs=torch.full((1, 1), -2.0),
            kl_coef=0.5,
            kl_estimator=kl,
        )
        loss.backward()
        assert loss.item() == pytest.approx(0.5 * value, rel=1e-6), kl
        assert m["kl_ref"].item() == pytest.approx(value, rel=1e-6), kl
        assert lp.grad.item() == pytest.approx(0.5 * grad, rel=1e-6), kl


def test_entropy_bonus_and_weighted_metrics():
    # two tokens with weights 3/4 and 1/4; entropy 2 and 4 -> weighted mean 2.5
    lp = torch.full((1, 2), -1.0, requires_grad=True)
    ent = torch.tensor([[2.0, 4.0]], requires_grad=True)
    w = torch.tensor([[0.75, 0.25]])
    loss, m = policy_loss(lp, lp.detach(), torch.zeros(1), w, entropy=ent, entropy_coef=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(-0.1 * 2.5)
    assert ent.grad[0].tolist() == pytest.approx([-0.075, -0.025])
    assert m["entropy"].item() == pytest.approx(2.5)
    assert "kl_ref" not in m


def test_zero_weight_and_empty_inputs_give_zero_loss_no_nan():
    lp = torch.randn(3, 4).requires_grad_()
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss, m = policy_loss(
        lp, lp.detach() + 1, torch.ones(3), RowWeights(mask, row_scales(mask, ["a", "b", "b"]))
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(3, 4))
    assert all(math.isfinite(v.item()) for v in m.values())
    empty = torch.zeros(0, 4, requires_grad=True)
    loss, _ = policy_loss(empty, empty.detach(), torch.zeros(0), torch.zeros(0, 4))
    loss.backward()
    assert loss.item() == 0.0


def test_policy_loss_errors():
    lp = torch.zeros(2, 3, requires_grad=True)
    w = torch.ones(2, 3)
    with pytest.raises(ValueError, match="kl_coef != 0 needs ref_logprobs"):
        policy_loss(lp, lp.detach(), torch.zeros(2), w, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef != 0 needs entropy"):
        policy_loss(lp, lp.detach(), torch.zeros(2), w, entropy_coef=0.1)
    with pytest.raises(ValueError, match="loss.kl_estimator: unknown KL estimator 'k9'; known: k1, k2, k3"):
        policy_loss(lp, lp.detach(), torch.zeros(2), w, ref_logprobs=lp.detach(), kl_estimator="k9")
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(lp, lp.detach(), torch.zeros(3), w)
    with pytest.raises(ValueError, match="old_logprobs must have the shape of logprobs"):
        policy_loss(lp, torch.zeros(2, 4), torch.zeros(2), w)
    with pytest.raises(ValueError, match="weights row scales must have shape"):
        policy_loss(
            lp,
            lp.detach(),
            torch.zeros(2),
            RowWeights(torch.ones(2, 3, dtype=torch.bool), torch.ones(3)),
        )
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(lp, lp.detach(), torch.zeros(2), w, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low must be < 1"):
        policy_loss(lp, lp.detach(), torch.zeros(2), w, clip_low=1.0)


# --- split invariance: one row per rollout vs each rollout cut into k rows ----------------------


class Bigram(torch.nn.Module):
    """A small torch model: the distribution of a token given the token before it."""

    def __init__(self, vocab=11, dim=5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g))

    def forward(self, prev, tok):
        logp = (self.emb[prev] @ self.out).log_softmax(-1)
        return logp.gather(-1, tok[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@st.composite
def rollouts_and_cuts(draw):
    n = draw(st.integers(1, 4))
    rollouts = []
    for _ in range(n):
        length = draw(st.integers(1, 12))
        tokens = draw(st.lists(st.integers(0, 10), min_size=length + 1, max_size=length + 1))
        mask = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3)) if length > 1 else [])
        rollouts.append((tokens, mask, cuts, draw(st.floats(-2, 2)), draw(st.integers(0, 10**6))))
    return rollouts


def layout(rollouts, cut: bool):
    """Rows [rows, W] of (prev token, token, mask, token id) for each rollout, whole or cut."""
    pieces = []  # (rollout k, [positions])
    for k, (_tokens, mask, cuts, _, _) in enumerate(rollouts):
        bounds = [0, *(cuts if cut else []), len(mask)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            pieces.append((k, list(range(a, b))))
    width = max(len(p) for _, p in pieces)
    n = len(pieces)
    prev = torch.zeros(n, width, dtype=torch.int64)
    tok = torch.zeros(n, width, dtype=torch.int64)
    mask = torch.zeros(n, width, dtype=torch.bool)
    where = torch.full((n, width), -1, dtype=torch.int64)  # global token id, -1 on padding
    offsets, o = [], 0
    for _tokens, m, *_ in rollouts:
        offsets.append(o)
        o += len(m)
    for i, (k, pos) in enumerate(pieces):
        tokens, m = rollouts[k][0], rollouts[k][1]
        for j, p in enumerate(pos):
            prev[i, j], tok[i, j], mask[i, j] = tokens[p], tokens[p + 1], m[p]
            where[i, j] = offsets[k] + p
    rollout_ids = [f"r{k}" for k, _ in pieces]
    return prev, tok, mask, where, rollout_ids, [k for k, _ in pieces], o


def per_token(values_by_id, where):
    """Scatter per-token data (indexed by global token id) into a row layout."""
    return torch.where(where >= 0, values_by_id[where.clamp(min=0)], torch.zeros(()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rollouts_and_cuts(),
    st.sampled_from(["rollout-mean", "token-mean"]),
    st.sampled_from(["k1", "k2", "k3"]),
)
def test_split_invariance_of_loss_and_gradient(rollouts, mode, kl):
    results = []
    for cut in (False, True):
        prev, tok, mask, where, ids, rollout_of_row, n_tokens = layout(rollouts, cut)
        g = torch.Generator().manual_seed(sum(r[4] for r in rollouts) % 1000)
        old_by_id = -torch.rand(n_tokens, generator=g) * 3
        ref_by_id = -torch.rand(n_tokens, generator=g) * 3
        model = Bigram()
        lp, ent = model(prev, tok)
        lp.retain_grad()
        adv = torch.tensor([rollouts[k][3] for k in rollout_of_row])
        loss, metrics = policy_loss(
            lp,
            per_token(old_by_id, where),
            adv,
            RowWeights(mask, row_scales(mask, ids, mode=mode)),
            ref_logprobs=per_token(ref_by_id, where),
            kl_coef=0.2,
            kl_estimator=kl,
            entropy=ent,
            entropy_coef=0.03,
        )
        loss.backward()
        token_grad = torch.zeros(n_tokens).index_put_((where[where >= 0],), lp.grad[where >= 0])
        results.append((loss.detach(), model.emb.grad, model.out.grad, token_grad, metrics))
    (l0, e0, o0, t0, m0), (l1, e1, o1, t1, m1) = results
    # Cut or whole, each token's terms are the same fp32 numbers; only the order of the sums
    # differs (cascade sums: a few u = 6e-8 of sum |x| each): rtol 1e-5 for sums and per-token
    # gradients. The parameters' gradients add up the token gradients through index_add / matmul
    # in another order, over up to ~100 tokens per entry: <~ 100 u = 6e-6 relative, hence 1e-4.
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-7)
    assert torch.allclose(t0, t1, rtol=1e-5, atol=1e-8)
    assert torch.allclose(e0, e1, rtol=1e-4, atol=1e-7)
    assert torch.allclose(o0, o1, rtol=1e-4, atol=1e-7)
    for key in ("weight_mass", "kl_ref", "entropy", "clip_frac", "approx_kl"):  # the KL and entropy
        assert torch.allclose(m0[key], m1[key], rtol=1e-5, atol=1e-7), key  # terms, split-invariant


def test_seq_mean_token_mean_is_not_split_invariant():
    """Documented: under seq-mean-token-mean a rollout cut into k rows weighs k/B."""
    whole = masses(
        token_weights(torch.ones(2, 2, dtype=torch.bool), ["A", "B"], mode="seq-mean-token-mean"),
        "AB",
    )
    cut_mask = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    cut = masses(token_weights(cut_mask, ["A", "B", "B"], mode="seq-mean-token-mean"), "ABB")
    assert whole == pytest.approx({"A": 1 / 2, "B": 1 / 2})
    assert cut == pytest.approx({"A": 1 / 3, "B": 2 / 3})


def test_rollout_mass_of_the_seed_case():
    """2 rollouts over 3 rows (A: rows 0,1 with 2+1 tokens; B: row 2 with 3): 1/2 each in
    rollout-mean, 3/6 and 3/6 in token-mean; over rows [A,A,A,B] of ones(4,3): 1/2, 1/2."""
    from tracetrain.objective.weights import rollout_mass

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    ids = ["A", "A", "B"]
    for mode in ("rollout-mean", "token-mean"):
        mass = rollout_mass(mask, ids, row_scales(mask, ids, mode=mode))
        torch.testing.assert_close(mass, torch.tensor([0.5, 0.5]))
    ones = torch.ones(4, 3, dtype=torch.bool)
    index = torch.tensor([0, 0, 0, 1])
    torch.testing.assert_close(rollout_mass(ones, index, row_scales(ones, index)), torch.tensor([0.5, 0.5]))
    # seq-mean-token-mean is not split invariant: the rollout cut in 2 rows weighs 2/3.
    mass = rollout_mass(mask, ids, row_scales(mask, ids, mode="seq-mean-token-mean"))
    torch.testing.assert_close(mass, torch.tensor([2 / 3, 1 / 3]))
