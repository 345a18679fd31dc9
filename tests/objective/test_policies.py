"""Several policies in one update (tracetrain/objective/policies.py): docs/invariants.md 11 (mass
per policy) and 12 (policy isolation), and the reduction to the single-policy weights, as
properties over random rows, rollouts and token-to-policy assignments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.objective.policies import policy_masks, policy_row_weights, rollouts_of_policy
from tracetrain.objective.weights import rollout_mass, row_scales

POLICIES = ("solver", "checker", "judge")
S = 8

# rows: (trained mask, policy of each token in 0..2, the row's rollout)
rows = st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=n, max_size=n),
    st.lists(st.lists(st.integers(0, len(POLICIES) - 1), min_size=S, max_size=S), min_size=n, max_size=n),
    st.lists(st.sampled_from("ABCDE"), min_size=n, max_size=n),
))


def tensors(data):
    mask_l, pol_l, ids = data
    mask = torch.tensor(mask_l, dtype=torch.bool)
    policy = torch.where(mask, torch.tensor(pol_l), torch.full((len(ids), S), -1))
    return mask, policy, ids


@settings(max_examples=80, deadline=None)
@given(rows)
def test_each_policys_rollouts_weigh_one_over_R_p(data):
    """Invariant 11: rollout-mean, every rollout holding a trained token of p has mass 1/R_p in
    p's weights; the others 0; p's weights cover p's tokens only."""
    mask, policy, ids = tensors(data)
    weights = policy_row_weights(mask, policy, ids, POLICIES)
    for p, name in enumerate(POLICIES):
        m_p, s_p = weights[name]
        assert torch.equal(m_p, mask & (policy == p))
        r_p = rollouts_of_policy(m_p, ids)
        mass = rollout_mass(m_p, ids, s_p)
        holds = [float(x) for x in mass if x > 0]
        assert len(holds) == r_p
        # each 1/(R_p T_r) summed over T_r tokens: within T_r float32 roundings of 1/R_p
        assert holds == pytest.approx([1 / r_p] * r_p, rel=S * len(ids) * 2e-7) if r_p else True
        assert float(mass.sum()) == pytest.approx(1.0 if r_p else 0.0, rel=1e-6)


@settings(max_examples=80, deadline=None)
@given(rows, st.data())
def test_another_policys_tokens_change_nothing_of_p(data, draw):
    """Invariant 12: adding rows of other policies, untraining their tokens or training tokens
    for them that were not trained, leaves policy 0's mask, R_p and row scales bit for bit."""
    mask, policy, ids = tensors(data)
    before = policy_row_weights(mask, policy, ids, POLICIES)["solver"]
    # the other policies' tokens changed: each of their trained tokens flipped at random
    flip = torch.tensor(draw.draw(st.lists(st.lists(st.booleans(), min_size=S, max_size=S),
                                           min_size=len(ids), max_size=len(ids))))
    others = policy > 0
    mask2 = torch.where(others, mask & ~flip, mask)
    policy = torch.where(~mask & flip, 2, policy)  # untrained tokens now trained for policy 2
    mask2 = mask2 | (~mask & flip)
    # and rows of other policies added, in new rollouts and in existing ones
    extra = draw.draw(st.integers(0, 3))
    add_ids = draw.draw(st.lists(st.sampled_from("AEFG"), min_size=extra, max_size=extra))
    mask2 = torch.cat([mask2, torch.ones(extra, S, dtype=torch.bool)])
    policy2 = torch.cat([policy, torch.full((extra, S), 1 + extra % 2)])
    after = policy_row_weights(mask2, policy2, list(ids) + add_ids, POLICIES)["solver"]
    n = len(ids)
    assert torch.equal(after.mask[:n], before.mask) and not after.mask[n:].any()
    assert torch.equal(after.scales[:n], before.scales)
    assert rollouts_of_policy(after.mask, list(ids) + add_ids) == rollouts_of_policy(before.mask, ids)


@settings(max_examples=60, deadline=None)
@given(rows, st.sampled_from(["rollout-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_one_policy_is_the_single_policy_run(data, mode):
    """Reduction: every trained token on one policy -> that policy's weights are row_scales of
    the whole mask, bit for bit, in every mode."""
    mask, _, ids = tensors(data)
    policy = torch.where(mask, 0, -1)
    (m, s), = policy_row_weights(mask, policy, ids, ["policy"], mode=mode).values()
    assert torch.equal(m, mask) and torch.equal(s, row_scales(mask, ids, mode=mode))


def test_a_trained_token_without_a_policy_or_a_bad_index_is_refused():
    mask = torch.tensor([[True, False]])
    with pytest.raises(ValueError, match="outside 0..1"):
        policy_masks(mask, torch.tensor([[-1, 0]]), 2)
    with pytest.raises(ValueError, match="outside 0..1"):
        policy_masks(mask, torch.tensor([[2, 0]]), 2)
    with pytest.raises(ValueError, match="one policy index per token"):
        policy_masks(mask, torch.tensor([0, 0]), 2)
    with pytest.raises(ValueError, match="integer policy indices"):
        policy_masks(mask, torch.tensor([[0.0, 0.0]]), 2)
