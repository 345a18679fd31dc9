"""Advantages against numbers worked out by hand, for every estimator; groups of one and of equal
rewards; failed rollouts excluded or zeroed; inconsistent rows rejected; broadcast to tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tracetrain.objective.advantage import (
    ESTIMATORS,
    batch_advantages,
    broadcast_to_tokens,
    compute_advantages,
    per_rollout,
    rollout_advantages,
)
from tracetrain.rows.batch import TrainingBatch

# Group "a": rewards 1, 2, 6 -> mean 3, deviations -2, -1, 3, unbiased var (4+1+9)/2 = 7.
# Group "b": rewards 0, 1 -> mean 1/2, deviations -1/2, 1/2, unbiased var 1/2.
# Group "c": one member (reward 5).  Group "d": rewards 4, 4 (zero variance).
REWARDS = [1.0, 2.0, 6.0, 0.0, 1.0, 5.0, 4.0, 4.0]
GROUPS = ["a", "a", "a", "b", "b", "c", "d", "d"]
S7, SH = math.sqrt(7), math.sqrt(0.5)
# reinforce++: centred rewards over the batch are -2, -1, 3, -1/2, 1/2, 0, 0, 0 (mean 0);
# unbiased batch variance (4 + 1 + 9 + 1/4 + 1/4) / 7 = 14.5 / 7.
SB = math.sqrt(14.5 / 7)
EXPECTED = {
    "grpo": [-2 / S7, -1 / S7, 3 / S7, -0.5 / SH, 0.5 / SH, 0, 0, 0],
    "dr-grpo": [-2, -1, 3, -0.5, 0.5, 0, 0, 0],
    # leave-one-out: 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2; 0 - 1, 1 - 0
    "rloo": [-3, -1.5, 4.5, -1, 1, 0, 0, 0],
    "reinforce++": [-2 / SB, -1 / SB, 3 / SB, -0.5 / SB, 0.5 / SB, 0, 0, 0],
}


@pytest.mark.parametrize("estimator", sorted(EXPECTED))
def test_estimators_by_hand(estimator):
    adv = compute_advantages(torch.tensor(REWARDS), GROUPS, estimator=estimator, eps=0.0)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(EXPECTED[estimator], rel=1e-6, abs=1e-7)


def test_eps_is_added_to_the_std():
    adv = compute_advantages([0.0, 1.0], ["g", "g"], estimator="grpo", eps=0.1)
    assert adv.tolist() == pytest.approx([-0.5 / (SH + 0.1), 0.5 / (SH + 0.1)], rel=1e-6)


def test_singleton_and_zero_variance_groups_give_exactly_zero_and_are_counted():
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: still exactly 0, no eps noise
    r = rollout_advantages([0.1, 0.1, 0.1, 7.0, 1.0, 3.0], ["z", "z", "z", "one", "g", "g"])
    assert r.values[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert r.values[4].item() < 0 < r.values[5].item()
    assert r.metrics["n_groups"] == 3
    assert r.metrics["n_singleton_groups"] == 1
    assert r.metrics["n_zero_variance_groups"] == 1
    for estimator in ESTIMATORS:
        adv = compute_advantages([0.1, 0.1, 0.1, 7.0], ["z", "z", "z", "one"], estimator=estimator)
        assert adv.tolist() == [0.0] * 4, estimator


def test_failed_rollouts_are_excluded_before_grouping():
    rewards = [1.0, 0.0, None, 1.0]
    states = ["succeeded", "succeeded", "failed", "timed_out"]
    r = rollout_advantages(rewards, ["g"] * 4, states)
    # only 1 and 0 remain in the group: mean 1/2, std sqrt(1/2)
    assert r.keep.tolist() == [True, True, False, False]
    assert r.values.tolist() == pytest.approx([0.5 / SH, -0.5 / SH, 0.0, 0.0], rel=1e-5)
    assert r.metrics["n_excluded_failed"] == 2
    assert r.metrics["n_rollouts"] == 2 and r.metrics["n_failed_as_zero_reward"] == 0


def test_failed_rollouts_as_zero_reward_when_asked():
    states = ["succeeded", "succeeded", "failed", "timed_out"]
    r = rollout_advantages([1.0, 0.0, None, 1.0], ["g"] * 4, states, failed_rollouts="zero_reward")
    # rewards 1, 0, 0, 0: mean 1/4, unbiased std sqrt((9/16 + 3/16) / 3) = 1/2
    assert r.keep.all()
    assert r.values.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    assert r.metrics["n_failed_as_zero_reward"] == 2 and r.metrics["n_excluded_failed"] == 0


def test_missing_reward_unfinished_rollout_and_bad_options_are_errors():
    with pytest.raises(ValueError, match="rollout 1 succeeded but has no reward"):
        rollout_advantages([1.0, None], ["g", "g"], ["succeeded", "succeeded"])
    with pytest.raises(ValueError, match=r"rewards\[1\] is missing"):
        compute_advantages([1.0, float("nan")], ["g", "g"])
    with pytest.raises(ValueError, match="rollout 0 is in state 'running'"):
        rollout_advantages([1.0], ["g"], ["running"])
    with pytest.raises(ValueError, match="states\\[0\\] is 'crashed'; known states"):
        rollout_advantages([1.0], ["g"], ["crashed"])
    with pytest.raises(
        ValueError,
        match="unknown advantage estimator 'ppo'; known: grpo, dr-grpo, rloo, reinforce\\+\\+",
    ):
        compute_advantages([1.0], ["g"], estimator="ppo")
    with pytest.raises(ValueError, match="failed_rollouts must be one of"):
        rollout_advantages([1.0], ["g"], failed_rollouts="drop")
    with pytest.raises(ValueError, match="group_ids has 1 entries, expected 2"):
        compute_advantages([1.0, 2.0], ["g"])
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("inf")], ["g", "g"])


def test_per_rollout_collapses_rows_and_rejects_disagreement():
    rollouts, index, groups, rewards = per_rollout(
        ["r2", "r2", "r1", "r3"], ["g", "g", "g", "h"], [1.0, 1.0, 0.0, None]
    )
    assert rollouts == ["r2", "r1", "r3"]
    assert index.tolist() == [0, 0, 1, 2]
    assert groups == ["g", "g", "h"]
    assert rewards[:2].tolist() == [1.0, 0.0] and math.isnan(rewards[2].item())
    with pytest.raises(
        ValueError, match=r"rollout 'r1': its rows carry different rewards: \[0.0, 1.0\]"
    ):
        per_rollout(["r1", "r1"], ["g", "g"], [1.0, 0.0])
    with pytest.raises(ValueError, match="rollout 'r1': its rows carry different rewards"):
        per_rollout(["r1", "r1"], ["g", "g"], [1.0, None])
    with pytest.raises(
        ValueError, match=r"rollout 'r1': its rows carry different group ids: \['g', 'h'\]"
    ):
        per_rollout(["r0", "r1", "r1"], ["g", "g", "h"])


def make_batch(rows_of: list[tuple[str, str]], rollouts, rewards, states) -> TrainingBatch:
    n = len(rows_of)
    order = {r: k for k, r in enumerate(rollouts)}
    mask = torch.ones(n, 3, dtype=torch.bool)
    return TrainingBatch(
        input_ids=torch.ones(n, 5, dtype=torch.int64),
        attention_mask=torch.ones(n, 5, dtype=torch.int64),
        position_ids=torch.arange(5).repeat(n, 1),
        response_mask=mask,
        rollout_logprobs=None,
        rollout_ids=[r for r, _ in rows_of],
        group_ids=[g for _, g in rows_of],
        turn_index=torch.zeros(n, dtype=torch.int64),
        rollout_index=torch.tensor([order[r] for r, _ in rows_of]),
        rollouts=list(rollouts),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        rollout_states=list(states),
    )


def test_batch_advantages_drops_failed_rollouts_whole():
    batch = make_batch(
        [("r0", "g"), ("r0", "g"), ("r1", "g"), ("r2", "g"), ("r2", "g"), ("r3", "h")],
        ["r0", "r1", "r2", "r3", "r4"],
        [1.0, 0.0, float("nan"), 2.0, 3.0],
        ["succeeded", "succeeded", "failed", "succeeded", "succeeded"],  # r4 has no rows
    )
    kept, adv, metrics = batch_advantages(batch, estimator="dr-grpo")
    assert kept.rollouts == ["r0", "r1", "r3"]
    assert kept.rollout_ids == ["r0", "r0", "r1", "r3"]
    assert kept.rollout_index.tolist() == [0, 0, 1, 2]
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0])  # r3 is alone in group h
    assert metrics["n_excluded_failed"] == 1 and metrics["n_excluded_no_rows"] == 1
    assert metrics["n_singleton_groups"] == 1 and metrics["n_groups"] == 2
    tokens = broadcast_to_tokens(adv, kept.rollout_index, kept.response_mask)
    assert tokens[:, 0].tolist() == pytest.approx([0.5, 0.5, -0.5, 0.0])


def test_batch_advantages_rejects_a_rollout_in_two_groups():
    batch = make_batch(
        [("r0", "g"), ("r0", "h"), ("r1", "g")], ["r0", "r1"], [1.0, 0.0], ["succeeded"] * 2
    )
    with pytest.raises(ValueError, match="rollout 'r0': its rows carry different group ids"):
        batch_advantages(batch)


def test_broadcast_puts_the_rollout_value_on_trained_tokens_only():
    values = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = broadcast_to_tokens(values, torch.tensor([0, 0, 1]), mask)
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]
    with pytest.raises(ValueError, match="rollout_index values must be in"):
        broadcast_to_tokens(values, torch.tensor([0, 0, 2]), mask)
