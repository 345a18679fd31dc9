"""Roles and credit per turn, as properties (docs/invariants.md invariants 1-3, 7, 8): rows per trained role,
each turn's tokens carrying its own advantage wherever it landed, turn-level estimators that reduce
to the rollout-level ones without turn rewards, and a loss that calls of a role that does not train
cannot move."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.objective.advantage import batch_advantages, broadcast_to_tokens
from tracetrain.objective.credit import (
    TURN_ESTIMATORS,
    batch_credit,
    returns_to_go,
    token_advantages,
    turn_advantages,
)
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import RowWeights, row_scales
from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.roles import role_metrics, role_orders
from tracetrain.types import Rollout, Turn

TURN_LEVEL = ("return-to-go", "gigpo")  # the built-in turn-level estimators
assert set(TURN_LEVEL) <= set(TURN_ESTIMATORS)

LIMITS = {"max_prompt_length": 512, "max_response_length": 512}


def make_rollout(rid: str, gid: str, roles: list[str], seed: int, reward: float,
                 turn_rewards: dict[int, float] | None = None, shared_prompt: bool = False) -> Rollout:
    """Turns made by `roles` in order; each role continues its own conversation (its prompt is
    its previous prompt + response + a new observation), as separate agents of one program do.
    shared_prompt: every rollout of a seed starts each role from the same first prompt."""
    rng = random.Random(seed)
    first = random.Random(hash(gid) % 1000 if shared_prompt else seed)
    context: dict[str, list[int]] = {}
    turns = []
    for k, role in enumerate(roles):
        start = context.get(role)
        if start is None:
            start = [first.randrange(5, 60) for _ in range(first.randint(1, 4))] + [ord(role[0])]
        obs = [rng.randrange(5, 60) for _ in range(rng.randint(0, 3))] if role in context else []
        prompt = start + obs
        response = [rng.randrange(5, 60) for _ in range(rng.randint(1, 4))]
        lps = [-0.125 * rng.randint(1, 16) for _ in response]
        reward_k = None if turn_rewards is None else turn_rewards.get(k)
        turns.append(Turn(prompt, response, lps, 0, role, reward_k))
        context[role] = prompt + response
    return Rollout(rid, gid, turns, reward)


@st.composite
def batches(draw, max_groups=3, rewards=True):
    """Groups of rollouts of two roles (solver, checker) with final and turn rewards."""
    rollouts = []
    for g in range(draw(st.integers(1, max_groups))):
        for n in range(draw(st.integers(1, 4))):
            roles = draw(st.lists(st.sampled_from(["solver", "checker"]), min_size=1, max_size=5))
            tr = {}
            if rewards:
                tr = draw(st.dictionaries(st.integers(0, len(roles) - 1),
                                          st.sampled_from([-1.0, 0.1, 0.25, 1 / 3, 1.0]), max_size=3))
            # (0.1, 0.3, 0.7 and 1/3 are inexact in binary: sums of them round, as real rewards do)
            final = draw(st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0, 1 / 3]))
            rollouts.append(make_rollout(f"g{g}-r{n}", f"g{g}", roles, draw(st.integers(0, 10**6)),
                                         final, tr, shared_prompt=draw(st.booleans())))
    return rollouts


def trained_batch(rollouts, train_roles, level="trajectory", **kw):
    batch, _ = aggregate(rollouts, level=level, train_roles=train_roles, **{**LIMITS, **kw})
    return batch


# --- rows per role ------------------------------------------------------------------------------


def test_a_roles_chain_stays_one_row_when_another_role_calls_in_between():
    r = make_rollout("r", "g", ["solver", "checker", "solver", "checker", "solver"], seed=1,
                     reward=1.0)
    assert role_orders(r.turns, None) == [[0, 2, 4], [1, 3]]
    only_solver, m = aggregate([r], train_roles=["solver"], **LIMITS)
    assert only_solver.n_rows == 1 and m["breaks/total"] == 0  # the checker's calls break nothing
    assert [k for k, _, _ in only_solver.turn_spans[0]] == [0, 2, 4]
    n_solver = sum(len(r.turns[k].response_ids) for k in (0, 2, 4))
    assert int(only_solver.response_mask.sum()) == n_solver
    both, m = aggregate([r], **LIMITS)  # every role trains: one row per role, still no break
    assert both.n_rows == 2 and m["breaks/total"] == 0 and both.n_rollouts == 1
    assert [[k for k, _, _ in s] for s in both.turn_spans] == [[0, 2, 4], [1, 3]]
    per_turn, _ = aggregate([r], level="transition", train_roles=["solver"], **LIMITS)
    assert per_turn.n_rows == 3  # transition: one row per trained turn


def test_a_rollout_whose_trained_roles_made_no_call_has_no_row_and_is_not_counted():
    a = make_rollout("a", "g", ["checker", "checker"], seed=2, reward=1.0)
    b = make_rollout("b", "g", ["solver"], seed=3, reward=0.0)
    batch, m = aggregate([a, b], train_roles=["solver"], **LIMITS)
    assert batch.rollouts == ["b"] and m["dropped_rollouts/no_trained_tokens"] == 1
    rm = role_metrics([a, b], ["solver"])
    assert (rm["roles/checker/turns"], rm["roles/checker/trained"]) == (2, 0.0)
    assert (rm["roles/solver/turns"], rm["roles/solver/trained"]) == (1, 1.0)


# --- each turn's tokens carry that turn's advantage, whatever row it landed in -------------------


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(["trajectory", "transition"]), st.sampled_from([6, 9, 512]),
       st.sampled_from([None, ["solver"]]), st.sampled_from(TURN_LEVEL), st.floats(0, 1))
def test_each_turns_tokens_carry_its_advantage_whatever_row_it_landed_in(
        rollouts, level, max_response, train_roles, estimator, gamma):
    batch, _ = aggregate(rollouts, level=level, train_roles=train_roles, max_prompt_length=512,
                         max_response_length=max_response, overlong="truncate")
    if not batch.n_rows:
        return
    kept = {r.rollout_id: r for r in rollouts}
    per_turn, _ = turn_advantages([kept[i] for i in batch.rollouts], batch.rewards.tolist(),
                                  estimator=estimator, train_roles=train_roles, gamma=gamma)
    by_id = dict(zip(batch.rollouts, per_turn, strict=True))
    tok = token_advantages(batch, by_id)
    covered = torch.zeros_like(batch.response_mask)
    for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
        for k, start, n in spans:
            assert kept[rid].turns[k].role in (train_roles or ("solver", "checker"))
            assert torch.all(tok[i, start : start + n] == torch.tensor(by_id[rid][k]))
            # the span holds turn k's own response ids
            got = batch.responses[i, start : start + n].tolist()
            assert got == list(kept[rid].turns[k].response_ids)[:n]
            covered[i, start : start + n] = True
    assert torch.equal(covered, batch.response_mask)  # the spans are exactly the trained tokens
    assert torch.all(tok[~batch.response_mask] == 0)


# --- credit reduces (invariant 8) ----------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(batches(rewards=False), st.sampled_from(TURN_LEVEL), st.floats(0, 1),
       st.sampled_from([None, ["solver"]]), st.sampled_from([0.5, 1.0, 2.0]))
def test_without_turn_rewards_turn_credit_is_exactly_grpos(rollouts, estimator, gamma, train_roles,
                                                          step_weight):
    batch = trained_batch(rollouts, train_roles)
    if not batch.n_rows:
        return
    kept, grpo, _ = batch_advantages(batch, estimator="grpo")
    expected = broadcast_to_tokens(grpo, kept.rollout_index, kept.response_mask)
    _, tok, metrics = batch_credit(batch, rollouts, estimator=estimator, train_roles=train_roles,
                                   gamma=gamma, step_weight=step_weight)
    assert torch.equal(tok, expected)  # bit for bit
    assert metrics["turn_adv_spread"] == 0.0


def test_return_to_go_by_hand():
    """Two rollouts of one group, each two solver turns; x = turn rewards; gamma = 0.5."""
    a = make_rollout("a", "g", ["solver", "solver"], 1, reward=1.0, turn_rewards={0: 1.0})
    b = make_rollout("b", "g", ["solver", "checker", "solver"], 2, reward=0.0,
                     turn_rewards={1: 2.0})  # the checker's reward goes to solver turn 0
    assert returns_to_go([1.0, 0.0], 0.5).tolist() == [1.0, 0.0]
    (pa, pb), _ = turn_advantages([a, b], [1.0, 0.0], estimator="return-to-go",
                                  train_roles=["solver"], gamma=0.5)
    g = {"a": [1.0 + 1.0, 0.0 + 1.0], "b": [2.0 + 0.0, 0.0 + 0.0]}  # G = rtg(x) + R
    mu = (sum(g["a"]) / 2 + sum(g["b"]) / 2) / 2
    var = (sum((v - mu) ** 2 for v in g["a"]) / 2 + sum((v - mu) ** 2 for v in g["b"]) / 2) / 1
    sd = var**0.5
    assert pa == pytest.approx({0: (2.0 - mu) / (sd + 1e-6), 1: (1.0 - mu) / (sd + 1e-6)})
    assert pb == pytest.approx({0: (2.0 - mu) / (sd + 1e-6), 2: (0.0 - mu) / (sd + 1e-6)})


def test_gigpo_step_groups_compare_turns_from_the_same_prompt():
    """Two rollouts from the same first prompt: their first turns form a step group; the one
    whose turn earned more gets the higher step advantage; later turns (other prompts) get none."""
    a = make_rollout("a", "g", ["solver", "solver"], 1, reward=1.0, turn_rewards={0: 1.0},
                     shared_prompt=True)
    b = make_rollout("b", "g", ["solver", "solver"], 2, reward=1.0, shared_prompt=True)
    assert list(a.turns[0].prompt_ids) == list(b.turns[0].prompt_ids)
    (pa, pb), m = turn_advantages([a, b], [1.0, 1.0], estimator="gigpo", gamma=1.0,
                                  step_weight=0.5)
    assert m["n_step_groups"] == 1
    episode = {"a": 2.0, "b": 1.0}  # R + turn rewards: grpo -> +-1/(sqrt(0.5) + eps)
    ae = (episode["a"] - 1.5) / (0.5**0.5 + 1e-6)
    step = 0.5 / (0.5**0.5 + 1e-6)  # S = 1 and 0 in the step group
    assert pa == pytest.approx({0: ae + 0.5 * step, 1: ae})
    assert pb == pytest.approx({0: -ae - 0.5 * step, 1: -ae})


# --- role invariance (invariant 7) ---------------------------------------------------------------


def loss_and_grads(batch, adv):
    lp = -torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    lp = (lp * batch.response_mask).requires_grad_()
    old = batch.rollout_logprobs
    weights = RowWeights(batch.response_mask, row_scales(batch.response_mask, batch.rollout_index))
    loss, m = policy_loss(lp, old, adv, weights, kl_coef=0.0)
    loss.backward()
    return loss.detach(), lp.grad, m


@settings(max_examples=60, deadline=None)
@given(batches(), st.data(), st.sampled_from(["grpo", *TURN_LEVEL]), st.floats(0, 1))
def test_calls_of_a_role_that_does_not_train_change_nothing(rollouts, data, estimator, gamma):
    """Insert checker calls (no reward) anywhere in the solver's rollouts, the checker not
    trained: the rows, R, the advantages, L and its gradient are the same."""
    solo, mixed = [], []
    for j, r in enumerate(rollouts):
        solver = [t for t in r.turns if t.role == "solver"]
        if not solver:
            continue
        solo.append(Rollout(r.rollout_id, r.group_id, solver, r.reward))
        turns = list(solver)
        for _ in range(data.draw(st.integers(0, 3))):
            at = data.draw(st.integers(0, len(turns)))
            turns.insert(at, Turn([7, 8, 9 + j], [10, 11], [-0.5, -0.5], 0, "checker"))
        mixed.append(Rollout(r.rollout_id, r.group_id, turns, r.reward))
    if not solo:
        return
    out = []
    for rs in (solo, mixed):
        batch = trained_batch(rs, ["solver"])
        batch, adv, _ = batch_credit(batch, rs, estimator=estimator, train_roles=["solver"],
                                     gamma=gamma)
        out.append((batch, adv, loss_and_grads(batch, adv)))
    (b0, a0, (l0, g0, m0)), (b1, a1, (l1, g1, m1)) = out
    for key in ("input_ids", "response_mask", "rollout_logprobs", "rollout_index", "rewards"):
        assert torch.equal(getattr(b0, key), getattr(b1, key)), key
    assert b0.n_rollouts == b1.n_rollouts  # R
    assert torch.equal(a0, a1) and torch.equal(l0, l1) and torch.equal(g0, g1)


# --- split, mass and partition invariance with per-turn advantages (invariants 1-3) -------------


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from(TURN_LEVEL), st.sampled_from([1, 7, 20]))
def test_cutting_rollouts_into_rows_or_micro_batches_changes_nothing_with_turn_credit(
        rollouts, estimator, budget):
    """trajectory (one row per role) vs transition (one row per turn): the same per-token loss
    gradient and L; every mass 1; micro-batches of `budget` tokens sum to the whole."""
    results = []
    for level in ("trajectory", "transition"):
        batch = trained_batch(rollouts, None, level=level)
        batch, adv, _ = batch_credit(batch, rollouts, estimator=estimator)
        g = torch.Generator().manual_seed(1)
        by_token: dict[tuple[str, int, int], float] = {}  # the same logprob for the same token
        lp = torch.zeros(batch.response_mask.shape)
        for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
            for k, start, n in spans:
                for j in range(n):
                    key = (rid, k, j)
                    if key not in by_token:
                        by_token[key] = -float(torch.rand((), generator=g)) - 0.01
                    lp[i, start + j] = by_token[key]
        lp.requires_grad_()
        old = (lp.detach() * 0.9)
        mask, ri = batch.response_mask, batch.rollout_index
        scales = row_scales(mask, ri)
        loss, m = policy_loss(lp, old, adv, RowWeights(mask, scales))
        loss.backward()
        assert float(m["weight_mass"]) == pytest.approx(1.0, abs=1e-6)
        grads = {}
        for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
            for k, start, n in spans:
                for j in range(n):
                    grads[(rid, k, j)] = float(lp.grad[i, start + j])
        (mb,) = plan_step(mask, ri, micro_batch_tokens=budget)
        parts = sum(float(policy_loss(lp.detach()[x.rows], old[x.rows], adv[x.rows],
                                      RowWeights(mask[x.rows], x.row_scales))[0])
                    for x in mb.micro_batches)
        assert parts == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)  # partition
        results.append((float(loss.detach()), grads))
    (l0, g0), (l1, g1) = results
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-7)  # split
    assert g0.keys() == g1.keys()
    for key in g0:
        assert g0[key] == pytest.approx(g1[key], rel=1e-5, abs=1e-8), key


# --- the verl backend gets the same token advantages ---------------------------------------------


def test_verl_dataproto_carries_the_embedded_trainers_token_advantages():
    pytest.importorskip("verl")
    from tracetrain.integrations.verl.dataproto import from_dataproto, to_dataproto

    rollouts = [make_rollout(f"r{i}", f"g{i // 2}", ["solver", "checker", "solver"], seed=i,
                             reward=float(i % 2), turn_rewards={0: 0.5 * i})
                for i in range(6)]
    batch = trained_batch(rollouts, ["solver"])
    batch, adv, _ = batch_credit(batch, rollouts, estimator="return-to-go", train_roles=["solver"],
                                 gamma=0.9)
    assert adv.shape == batch.response_mask.shape and float(adv.abs().sum()) > 0
    proto = to_dataproto(batch, adv, n_mini_batches=2, dp_size=2)
    back, adv_back, _ = from_dataproto(proto)
    assert proto.meta_info["token_advantages"] is True
    assert torch.equal(adv_back, adv)  # every token's own advantage, rows in batch order
    rows = proto.batch["row_index"]
    for slot, i in enumerate(rows.tolist()):
        expected = adv[i] if i >= 0 else torch.zeros(adv.shape[1])
        assert torch.equal(proto.batch["advantages"][slot], expected)
