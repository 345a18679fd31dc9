"""On-policy distillation as token-level credit (objective/distill.py), as properties: each taught
token carries coef · (λ_T − λ_S) (plus its reward-based advantage with with_reward) wherever its
rollout was cut, a teacher equal to the sampling policy adds nothing, and the loss keeps its
invariants with the teacher on, alone and mixed (docs/invariants.md invariants 1-3, 7): every
rollout weighs 1/R, L and ∇L do not depend on the rows or the micro-batches, and calls of a role
that does not train change nothing."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_credit import batches, loss_and_grads, trained_batch

from tracetrain.objective.credit import batch_credit
from tracetrain.objective.distill import distill_advantages, teacher_logprobs, token_level
from tracetrain.objective.loss import policy_loss
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import RowWeights, row_scales
from tracetrain.types import Rollout, Turn


def teacher_of(rollouts, roles=("solver", "checker"), seed=0) -> dict:
    """Random teacher logprobs (dyadic: exact in fp32) for every turn of `roles`."""
    rng = random.Random(seed)
    return {r.rollout_id: {k: [-0.0625 * rng.randint(0, 64) for _ in t.response_ids]
                           for k, t in enumerate(r.turns) if t.role in roles}
            for r in rollouts}


def credited(rollouts, teacher, *, level="trajectory", estimator="grpo", coef=1.0,
             with_reward=False, train_roles=None, **kw):
    batch = trained_batch(rollouts, train_roles, level=level, **kw)
    batch, adv, _ = batch_credit(batch, rollouts, estimator=estimator, train_roles=train_roles)
    out, metrics = distill_advantages(batch, adv, teacher, coef=coef, with_reward=with_reward)
    return batch, adv, out, metrics


def per_token(batch, values) -> dict[tuple[str, int, int], float]:
    """{(rollout, turn, j): value at that token} over the batch's trained tokens."""
    out = {}
    for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
        for k, start, n in spans:
            for j in range(n):
                out[(rid, k, j)] = float(values[i, start + j])
    return out


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(["trajectory", "transition"]), st.sampled_from([6, 9, 512]),
       st.sampled_from(["grpo", "return-to-go"]), st.sampled_from([0.5, 1.0, 2.0]), st.booleans(),
       st.sampled_from([None, ["solver"]]))
def test_each_taught_token_carries_its_teacher_term_wherever_it_landed(
        rollouts, level, max_response, estimator, coef, with_reward, taught_roles):
    """A[i,t] = with_reward · A_RL[i,t] + coef · (λ_T − λ_S) on taught tokens, A_RL elsewhere
    (with_reward) or 0: by (rollout, turn, token), whatever the rows and the response limit."""
    by_id = {r.rollout_id: r for r in rollouts}
    teacher = teacher_of(rollouts, taught_roles or ("solver", "checker"))
    batch, adv, out, metrics = credited(rollouts, teacher, level=level, estimator=estimator,
                                        coef=coef, with_reward=with_reward,
                                        max_response_length=max_response, overlong="truncate")
    rl = per_token(batch, token_level(batch, adv))
    got = per_token(batch, out)
    n_taught, kl = 0, 0.0
    for (rid, k, j), a in got.items():
        turn = by_id[rid].turns[k]
        base = rl[(rid, k, j)] if with_reward else 0.0
        if k in teacher[rid]:
            d = teacher[rid][k][j] - turn.response_logprobs[j]  # dyadic: exact in fp32
            assert a == pytest.approx(base + coef * d, abs=1e-6)
            n_taught, kl = n_taught + 1, kl - d
        else:
            assert a == base
    assert float(out[~batch.response_mask].abs().sum()) == 0  # nothing off the trained tokens
    assert metrics["distill/taught_tokens"] == n_taught
    assert metrics["distill/reverse_kl"] == pytest.approx(kl / n_taught if n_taught else 0.0,
                                                          abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(batches(), st.booleans())
def test_a_teacher_equal_to_the_sampling_policy_adds_nothing(rollouts, with_reward):
    own = {r.rollout_id: {k: list(t.response_logprobs) for k, t in enumerate(r.turns)}
           for r in rollouts}
    batch, adv, out, metrics = credited(rollouts, own, with_reward=with_reward)
    want = token_level(batch, adv) if with_reward else torch.zeros_like(out)
    assert torch.equal(out, want)
    assert metrics["distill/reverse_kl"] == 0.0


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from([1, 7, 20]), st.booleans(),
       st.sampled_from(["grpo", "return-to-go"]))
def test_mass_split_and_partition_invariance_hold_with_a_teacher(rollouts, budget, with_reward,
                                                                 estimator):
    """trajectory vs transition rows: the same L and per-token gradient; every update's mass 1,
    each rollout's 1/R; micro-batches of `budget` tokens sum to the whole."""
    teacher = teacher_of(rollouts)
    results = []
    for level in ("trajectory", "transition"):
        batch, _, adv, _ = credited(rollouts, teacher, level=level, estimator=estimator,
                                    with_reward=with_reward)
        g = torch.Generator().manual_seed(1)
        lp = torch.zeros(batch.response_mask.shape)
        seen: dict[tuple[str, int, int], float] = {}
        for key, _ in per_token(batch, lp).items():
            seen.setdefault(key, -float(torch.rand((), generator=g)) - 0.01)
        for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
            for k, start, n in spans:
                for j in range(n):
                    lp[i, start + j] = seen[(rid, k, j)]
        lp.requires_grad_()
        old = lp.detach() * 0.9
        mask, ri = batch.response_mask, batch.rollout_index
        scales = row_scales(mask, ri)
        loss, m = policy_loss(lp, old, adv, RowWeights(mask, scales))
        loss.backward()
        assert float(m["weight_mass"]) == pytest.approx(1.0, abs=1e-6)
        mass = torch.zeros(batch.n_rollouts).index_add_(0, ri, (mask * scales[:, None]).sum(1))
        assert torch.allclose(mass, torch.full_like(mass, 1 / batch.n_rollouts), atol=1e-6)
        (mb,) = plan_step(mask, ri, micro_batch_tokens=budget)
        parts = sum(float(policy_loss(lp.detach()[x.rows], old[x.rows], adv[x.rows],
                                      RowWeights(mask[x.rows], x.row_scales))[0])
                    for x in mb.micro_batches)
        assert parts == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)  # partition
        results.append((float(loss.detach()), per_token(batch, lp.grad)))
    (l0, g0), (l1, g1) = results
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-7)  # split
    assert g0.keys() == g1.keys()
    for key in g0:
        assert g0[key] == pytest.approx(g1[key], rel=1e-5, abs=1e-8), key


@settings(max_examples=40, deadline=None)
@given(batches(), st.data(), st.booleans())
def test_calls_of_a_role_that_does_not_train_change_nothing_with_a_teacher(rollouts, data,
                                                                            with_reward):
    """Checker calls (untrained, untaught) inserted among the solver's: rows, advantages, L and
    ∇L are the same (the teacher's scores follow their turns' new indices)."""
    solo, mixed, t_solo, t_mixed = [], [], {}, {}
    for j, r in enumerate(rollouts):
        solver = [t for t in r.turns if t.role == "solver"]
        if not solver:
            continue
        solo.append(Rollout(r.rollout_id, r.group_id, solver, r.reward))
        scores = [[-0.5 * (q % 3) for q in range(len(t.response_ids))] for t in solver]
        t_solo[r.rollout_id] = dict(enumerate(scores))
        turns, index = list(solver), list(range(len(solver)))
        for _ in range(data.draw(st.integers(0, 3))):
            at = data.draw(st.integers(0, len(turns)))
            turns.insert(at, Turn([7, 8, 9 + j], [10, 11], [-0.5, -0.5], 0, "checker"))
            index.insert(at, None)
        t_mixed[r.rollout_id] = {k: scores[s] for k, s in enumerate(index) if s is not None}
        mixed.append(Rollout(r.rollout_id, r.group_id, turns, r.reward))
    if not solo:
        return
    out = []
    for rs, teacher in ((solo, t_solo), (mixed, t_mixed)):
        batch, _, adv, _ = credited(rs, teacher, with_reward=with_reward, train_roles=["solver"])
        out.append((adv, loss_and_grads(batch, adv)))
    (a0, (l0, g0, _)), (a1, (l1, g1, _)) = out
    assert torch.equal(a0, a1) and torch.equal(l0, l1) and torch.equal(g0, g1)


def test_missing_logprobs_or_short_scores_are_refused():
    r = Rollout("r", "g", [Turn([1, 2], [3, 4, 5], [-1.0, -1.0, -1.0], 0, "solver")], 1.0)
    batch = trained_batch([r], None)
    with pytest.raises(ValueError, match="rollout 'r' turn 0: the teacher scored 2 tokens of the 3"):
        teacher_logprobs(batch, {"r": {0: [-1.0, -2.0]}})
    bare = Rollout("r", "g", [Turn([1, 2], [3, 4, 5], None, 0, "solver")], 1.0)
    batch = trained_batch([bare], None)
    with pytest.raises(ValueError, match="needs the sampled tokens' logprobs"):
        distill_advantages(batch, torch.zeros(1), {"r": {0: [-1.0] * 3}}, coef=1.0,
                           with_reward=False)
