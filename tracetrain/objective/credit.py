"""Credit per turn: the advantage each trained turn's response tokens carry.

Notation: rollout r of group g (n_g rollouts with rows) has final reward R_r and trained turns
k = 0..K_r-1 (the calls of the roles that train, in the order they were made; C_r), turn k with
turn reward x_{r,k}: the sum of the rewards given to it while the rollout ran, plus those given to
calls of roles that do not train between it and the next trained turn (what came of its action);
0 when none. A reward given before the first trained turn counts only in gigpo's episode return.
Turns are counted, for the discount, among the trained ones: calls of a role that does not train
change no advantage (docs/invariants.md invariant 7). Estimators, by name (the rollout-level ones of
advantage.py, and the turn-level ones registered here in TURN_ESTIMATORS):

| estimator      | A_{r,k} for k in C_r                                                         |
|----------------|------------------------------------------------------------------------------|
| grpo, dr-grpo, | A_r of advantage.py, from R_r alone (outcome-only credit: turn rewards are   |
| rloo,          | recorded and shown, not used)                                                |
| reinforce++    |                                                                              |
| return-to-go   | (G_{r,k} - mu_g) / (sigma_g + eps),  G_{r,k} = sum_{j>=k} gamma^(j-k) x_{r,j} + R_r |
|                | mu_g, sigma_g: mean and unbiased std of the group's G with each rollout      |
|                | weighing the same, its trained turns sharing that:                           |
|                |   mu_g = 1/n_g sum_r mean_{k in C_r} G_{r,k}                                  |
|                |   sigma_g^2 = 1/(n_g - 1) sum_r mean_{k in C_r} (G_{r,k} - mu_g)^2           |
| gigpo          | A^E_r + step_weight * A^S_{r,k}: A^E_r is grpo on the episode return         |
|                | R_r + all its turn rewards; A^S normalises S_{r,k} = sum_{j>=k} gamma^(j-k) x_{r,j} |
|                | (mean, unbiased std + eps) among the step group of (r, k): the trained turns |
|                | of g's rollouts whose prompt ids equal turn k's (the same observation)       |

A group of one rollout, or whose values are all equal, gives 0 (a step group likewise, for A^S).
With no turn rewards (x = 0) return-to-go gives every turn R_r - mu_g over sigma_g + eps, grpo's
A_r, and gigpo's S is 0: each reduces to grpo (docs/invariants.md invariant 8). The final reward is not
discounted: it is the outcome every turn shares, as with rollout-level credit; the discount
gamma spreads a turn reward back over the turns before it. (GiGPO's paper also counts the final
reward in S; here the step level compares only what turns earned along the way, which keeps
invariant 8.)

The token weights of the loss do not change with credit: a rollout still weighs 1/R, its trained
tokens share that; only the advantage a token carries varies by turn (`token_advantages`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tracetrain import registry
from tracetrain.objective.advantage import ESTIMATORS, batch_advantages, rollout_advantages
from tracetrain.rows.batch import TrainingBatch
from tracetrain.rows.roles import trains
from tracetrain.types import Rollout

TURN_ESTIMATORS = registry.TURN_ESTIMATORS
register_turn_estimator = TURN_ESTIMATORS.register


class TurnRewards(NamedTuple):
    """What a turn-level estimator sees of the batch's trained rollouts (module docstring)."""

    rollouts: Sequence[Rollout]
    trained: list[list[int]]  # C_r: the indices of each rollout's trained turns
    x: list[np.ndarray]  # x_{r,k} [K_r] float64
    before: list[float]  # the turn rewards given before each rollout's first trained turn
    final: list[float]  # R_r
    groups: list[str]  # group ids


# A turn-level estimator: (TurnRewards, gamma, step_weight, eps) -> (A_{r,k} [K_r] per rollout,
# metrics).
TurnEstimator = Callable[[TurnRewards, float, float, float], tuple[list[np.ndarray], dict[str, float]]]


def returns_to_go(rewards: Sequence[float], gamma: float) -> np.ndarray:
    """[K] float64: sum_{j>=k} gamma^(j-k) rewards[j] for every k (the last turn first)."""
    out = np.zeros(len(rewards), dtype=np.float64)
    acc = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[k]) + gamma * acc
        out[k] = acc
    return out


def _normalise(members: list[np.ndarray], eps: float) -> list[np.ndarray]:
    """(v - mu) / (sigma + eps) for each member's values (float64), mu and sigma^2 (unbiased) with
    each member weighing the same, its values sharing that; 0 for all when there is one member
    or every value is the same. A member whose values are all equal counts as that value, and
    the sums run in member order from 0.0, so members of one value each give, bit for bit, what
    advantage.grpo gives rollouts with those rewards (invariant 8)."""
    n = len(members)
    flat = np.concatenate(members) if members else np.zeros(0)
    if n < 2 or flat.max() == flat.min():
        return [np.zeros_like(m) for m in members]
    one = [bool(m.min() == m.max()) for m in members]
    mu = 0.0
    for m, single in zip(members, one, strict=True):
        mu += float(m[0]) if single else float(m.mean())
    mu /= n
    var = 0.0
    for m, single in zip(members, one, strict=True):
        var += (float(m[0]) - mu) * (float(m[0]) - mu) if single else float(((m - mu) ** 2).mean())
    sd = math.sqrt(var / (n - 1))
    return [(m - mu) / (sd + eps) for m in members]


def _per_rollout(t: TurnRewards, values: Sequence[float], estimator: str, eps: float) -> list[np.ndarray]:
    """Each trained turn of rollout r gets the rollout-level `estimator`'s A_r from `values`."""
    a_r = rollout_advantages(values, t.groups, estimator=estimator, eps=eps).values.double().numpy()
    return [np.full(len(c), a) for c, a in zip(t.trained, a_r, strict=True)]


@register_turn_estimator("return-to-go")
def return_to_go(t: TurnRewards, gamma: float, step_weight: float, eps: float):
    """(G_{r,k} - mu_g) / (sigma_g + eps), G_{r,k} = sum_{j>=k} gamma^(j-k) x_{r,j} + R_r."""
    adv = [np.zeros(len(c)) for c in t.trained]
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(t.groups):
        if t.trained[i]:
            by_group.setdefault(g, []).append(i)
    for members in by_group.values():
        g_vals = [returns_to_go(t.x[i], gamma) + t.final[i] for i in members]
        for i, a in zip(members, _normalise(g_vals, eps), strict=True):
            adv[i] = a
    return adv, {}


@register_turn_estimator("gigpo")
def gigpo(t: TurnRewards, gamma: float, step_weight: float, eps: float):
    """A^E_r + step_weight * A^S_{r,k}: grpo on the episode return, plus the step level."""
    episode = [f + b + float(xs.sum()) for f, b, xs in zip(t.final, t.before, t.x, strict=True)]
    adv, n_step_groups = _step_level(t, _per_rollout(t, episode, "grpo", eps), gamma, step_weight, eps)
    return adv, {"n_step_groups": n_step_groups}


def turn_advantages(
    rollouts: Sequence[Rollout],
    final: Sequence[float],
    *,
    estimator: str,
    train_roles: Collection[str] | None = None,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    others: Collection[str] = (),
) -> tuple[list[dict[int, float]], dict[str, float]]:
    """Per rollout, {turn index: A_{r,k}} for its trained turns (module docstring), and metrics.

    `rollouts` are the ones that train, in any order, `final` their final rewards R_r (the
    batch's: failed rollouts excluded or given 0 by the caller); groups are their group_ids.
    `estimator`: a rollout-level one (advantage.ESTIMATORS: outcome-only credit) or a turn-level
    one (TURN_ESTIMATORS). metrics: the estimator's (gigpo: n_step_groups, step groups of two or
    more turns), turn_adv_spread (mean over rollouts of max - min of A over their turns).
    `others` (several policies): the roles of the other policies, whose turn rewards are their
    credit, never this policy's (docs/invariants.md 12)."""
    registry.resolve("advantage.estimator", estimator)  # an unknown name: every known one listed
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    trained, x, before = [], [], []
    for r in rollouts:
        c, xs, early = _trained_rewards(r, train_roles, others)
        trained.append(c)
        x.append(xs)
        before.append(early)
    t = TurnRewards(rollouts, trained, x, before, [float(f) for f in final],
                    [r.group_id for r in rollouts])
    if estimator in ESTIMATORS:
        adv, metrics = _per_rollout(t, t.final, estimator, eps), {}
    else:
        adv, metrics = TURN_ESTIMATORS[estimator](t, gamma, step_weight, eps)
    spreads = [float(a.max() - a.min()) for a in adv if len(a)]
    metrics["turn_adv_spread"] = sum(spreads) / len(spreads) if spreads else 0.0
    out = [dict(zip(c, map(float, a), strict=True)) for c, a in zip(trained, adv, strict=True)]
    return out, metrics


def _trained_rewards(r: Rollout, train_roles, others=()) -> tuple[list[int], np.ndarray, float]:
    """(C_r: the trained turns' indices, x_{r,k} for them [K_r] float64, the rewards given before
    the first trained turn): a reward given to a call of a role that does not train goes to the
    trained turn before it, unless the role is another policy's (`others`)."""
    c: list[int] = []
    xs: list[float] = []
    early = 0.0
    for k, t in enumerate(r.turns):
        if trains(t.role, train_roles):
            c.append(k)
            xs.append(0.0)
        if t.reward is None or t.role in others:
            continue
        if xs:
            xs[-1] += float(t.reward)
        else:
            early += float(t.reward)
    return c, np.asarray(xs, dtype=np.float64), early


def _step_level(t: TurnRewards, adv, gamma, step_weight, eps):
    """adv + step_weight * A^S (gigpo), and the number of step groups of two or more turns."""
    steps: dict[tuple[str, bytes], list[tuple[int, int]]] = {}  # (group, observation) -> (i, j)
    s_vals = []
    for i, r in enumerate(t.rollouts):
        s_vals.append(returns_to_go(t.x[i], gamma))
        for j, k in enumerate(t.trained[i]):
            ids = np.asarray(r.turns[k].prompt_ids, dtype=np.int64)
            steps.setdefault((r.group_id, ids.tobytes()), []).append((i, j))  # exact ids
    out = [a.copy() for a in adv]
    n_groups = 0
    for members in steps.values():
        if len(members) < 2:
            continue
        n_groups += 1
        vals = [np.array([s_vals[i][j]]) for i, j in members]
        for (i, j), a in zip(members, _normalise(vals, eps), strict=True):
            out[i][j] += step_weight * float(a[0])
    return out, n_groups


def token_advantages(batch: TrainingBatch, per_turn: dict[str, dict[int, float]]) -> torch.Tensor:
    """[rows, S] float32: on each row, every trained turn's response tokens carry that turn's
    advantage, per_turn[rollout id][turn index] (batch.turn_spans says where they are); 0 on
    observation tokens and padding."""
    if batch.turn_spans is None:
        raise ValueError("token_advantages needs batch.turn_spans (a batch built by aggregate)")
    out = torch.zeros(batch.n_rows, batch.response_length, dtype=torch.float32)
    for i, (rid, spans) in enumerate(zip(batch.rollout_ids, batch.turn_spans, strict=True)):
        adv = per_turn[rid]
        for k, start, n in spans:
            out[i, start : start + n] = adv[k]
    return out


def batch_credit(
    batch: TrainingBatch,
    rollouts: Sequence[Rollout],
    *,
    estimator: str = "grpo",
    train_roles: Collection[str] | None = None,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    failed_rollouts: str = "exclude",
    others: Collection[str] = (),
) -> tuple[TrainingBatch, torch.Tensor, dict[str, float]]:
    """(batch without excluded rollouts, advantages, metrics) for `batch`, built from `rollouts`
    (`others`: turn_advantages).

    A rollout-level estimator gives advantage.batch_advantages' answer, one per rollout
    ([n_rollouts]). A turn-level one (TURN_ESTIMATORS) excludes the same rollouts, then gives
    [rows, S] token advantages: each trained turn's tokens its A_{r,k}."""
    registry.resolve("advantage.estimator", estimator)
    batch, values, metrics = batch_advantages(
        batch, estimator=estimator if estimator in ESTIMATORS else "grpo", eps=eps,
        failed_rollouts=failed_rollouts)
    if estimator in ESTIMATORS:
        return batch, values, metrics
    by_id = {r.rollout_id: r for r in rollouts}
    kept = [by_id[rid] for rid in batch.rollouts]
    final = torch.nan_to_num(batch.rewards, nan=0.0).tolist()  # a failed one trains as 0 here
    per_turn, more = turn_advantages(kept, final, estimator=estimator, train_roles=train_roles,
                                     gamma=gamma, step_weight=step_weight, eps=eps, others=others)
    metrics.update(more)
    return batch, token_advantages(batch, dict(zip(batch.rollouts, per_turn, strict=True))), metrics
