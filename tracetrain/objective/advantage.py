"""Advantages: one scalar per rollout, from its reward and its group, broadcast to its tokens.

For rollout r with reward x_r in group g (n_g members, mean mu_g, unbiased std sigma_g):

| estimator     | advantage                                                              |
|---------------|------------------------------------------------------------------------|
| grpo          | (x_r - mu_g) / (sigma_g + eps)                                         |
| dr-grpo       | x_r - mu_g                                                             |
| rloo          | x_r - (sum_g x - x_r) / (n_g - 1)   (the mean of the other members)    |
| reinforce++   | (x_r - mu_g) / (std_batch(x - mu) + eps): centred in its group, then   |
|               | divided by the unbiased std of those centred rewards over all rollouts |
|               | of the batch (no re-centring, not token-weighted)                       |

A group of one member, or whose rewards are all equal, gives advantage exactly 0 for each of its
members (no eps noise) and is counted: `n_singleton_groups`, `n_zero_variance_groups` (disjoint).

Rollouts in state failed / timed_out say nothing about the policy (docs/invariants.md invariant 6): by
default they are excluded before grouping (`failed_rollouts="exclude"`; they neither get an
advantage nor move their group's mean), with `"zero_reward"` to train them as reward 0 instead.
A rollout that succeeded without a reward (NaN) is an error: training it as 0 would be a silent
guess, and dropping it silently would hide a broken reward function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tracetrain import registry
from tracetrain.rows.batch import TrainingBatch
from tracetrain.types import RolloutState

# An estimator maps (rewards float64 [n], group index [n], n_groups, eps) -> advantages [n].
# Singleton and zero-variance groups are set to 0 afterwards, by compute_advantages.
Estimator = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]
ESTIMATORS = registry.ADVANTAGE_ESTIMATORS
register_estimator = ESTIMATORS.register


def _group_sum(x: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)


def _group_mean_std(x, group, n_groups):
    """Per-member group count, mean and unbiased std (std 0 for groups of one)."""
    count = _group_sum(torch.ones_like(x), group, n_groups)
    mean = _group_sum(x, group, n_groups) / count
    centred = x - mean[group]
    var = _group_sum(centred * centred, group, n_groups) / (count - 1).clamp(min=1)
    return count[group], mean[group], var.sqrt()[group]


@register_estimator("grpo")
def grpo(rewards, group, n_groups, eps):
    """(x - mu_g) / (sigma_g + eps)."""
    _, mean, std = _group_mean_std(rewards, group, n_groups)
    return (rewards - mean) / (std + eps)


@register_estimator("dr-grpo")
def dr_grpo(rewards, group, n_groups, eps):
    """x - mu_g (Dr. GRPO: no division by the std)."""
    _, mean, _ = _group_mean_std(rewards, group, n_groups)
    return rewards - mean


@register_estimator("rloo")
def rloo(rewards, group, n_groups, eps):
    """x - (sum_g - x) / (n_g - 1): the leave-one-out baseline."""
    count = _group_sum(torch.ones_like(rewards), group, n_groups)[group]
    total = _group_sum(rewards, group, n_groups)[group]
    return rewards - (total - rewards) / (count - 1).clamp(min=1)


@register_estimator("reinforce++")
def reinforce_pp(rewards, group, n_groups, eps):
    """(x - mu_g) / (std over the batch of (x - mu_g) + eps)."""
    _, mean, _ = _group_mean_std(rewards, group, n_groups)
    centred = rewards - mean
    batch_std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return centred / (batch_std + eps)


def _index(ids: Sequence[str] | torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, list]:
    """(inverse [n] int64, unique keys) for str ids or an int tensor of ids."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() != n:
            raise ValueError(
                f"{what} must be a 1-D int tensor of {n} ids, got {tuple(ids.shape)} {ids.dtype}"
            )
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return inverse.to(torch.int64), uniq.tolist()
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"{what} must be a list of str or an int tensor, got {type(ids).__name__}")
    if len(ids) != n:
        raise ValueError(f"{what} has {len(ids)} entries, expected {n}")
    if n == 0:
        return torch.zeros(0, dtype=torch.int64), []
    if set(map(type, ids)) != {str}:
        bad = next(x for x in ids if type(x) is not str)
        raise ValueError(f"{what} must all be str, found {bad!r} ({type(bad).__name__})")
    uniq, inverse = np.unique(np.asarray(ids), return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64)), uniq.tolist()


def _as_rewards(rewards, n: int | None = None) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        try:
            rewards = torch.tensor(
                [float("nan") if x is None else x for x in rewards], dtype=torch.float64
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"rewards must be numbers (or None for missing): {e}") from None
    if rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise ValueError(
            f"rewards must be a 1-D float tensor, got {tuple(rewards.shape)} {rewards.dtype}"
        )
    if n is not None and rewards.numel() != n:
        raise ValueError(f"rewards has {rewards.numel()} entries, expected {n}")
    if torch.isinf(rewards).any():
        k = int(torch.isinf(rewards).nonzero()[0])
        raise ValueError(f"rewards[{k}] is {float(rewards[k])}; a reward must be finite")
    return rewards.to(torch.float64)


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[str] | torch.Tensor,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages [n_rollouts] float32 of rollouts with these rewards and groups (one per rollout).

    Every reward must be present (no NaN); exclusion of failed rollouts is `rollout_advantages`.
    """
    adv, _ = _advantages(_as_rewards(rewards), group_ids, estimator, eps)
    return adv


def _advantages(rewards, group_ids, estimator, eps):
    ESTIMATORS.resolve(estimator)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    n = rewards.numel()
    if torch.isnan(rewards).any():
        k = int(torch.isnan(rewards).nonzero()[0])
        raise ValueError(f"rewards[{k}] is missing (NaN); every trained rollout needs a reward")
    group, keys = _index(group_ids, n, "group_ids")
    n_groups = len(keys)
    count = _group_sum(torch.ones_like(rewards), group, n_groups)
    hi = torch.full((n_groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce_(
        0, group, rewards, "amax"
    )
    lo = torch.full((n_groups,), torch.inf, dtype=rewards.dtype).scatter_reduce_(
        0, group, rewards, "amin"
    )
    singleton = count == 1
    flat = (count > 1) & (hi == lo)
    adv = ESTIMATORS[estimator](rewards, group, n_groups, float(eps))
    adv = torch.where((singleton | flat)[group], torch.zeros_like(adv), adv)
    metrics = {
        "n_rollouts": n,
        "n_groups": n_groups,
        "n_singleton_groups": int(singleton.sum()),
        "n_zero_variance_groups": int(flat.sum()),
        "reward_mean": float(rewards.mean()) if n else 0.0,
    }
    return adv.to(torch.float32), metrics


@dataclass
class Advantages:
    """Result of `rollout_advantages`: per-rollout values, which rollouts train, and counts."""

    values: torch.Tensor  # [n_rollouts] float32; 0 for excluded rollouts
    keep: torch.Tensor  # [n_rollouts] bool; False for excluded (failed / timed_out) rollouts
    metrics: dict[str, float]  # n_rollouts (kept), n_groups, n_singleton_groups,
    # n_zero_variance_groups, n_excluded_failed, n_failed_as_zero_reward, reward_mean


FAILED_POLICIES = ("exclude", "zero_reward")


def rollout_advantages(
    rewards: torch.Tensor | Sequence[float | None],
    group_ids: Sequence[str] | torch.Tensor,
    states: Sequence[str | RolloutState] | None = None,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    failed_rollouts: str = "exclude",
) -> Advantages:
    """Advantages of a batch's rollouts (one entry per rollout), handling infrastructure failures.

    states[k] is the RolloutState of rollout k (None: all succeeded). failed / timed_out rollouts
    are excluded before grouping ("exclude", default) or given reward 0 ("zero_reward"). A
    succeeded rollout without a reward, or one not finished, is an error naming it.
    """
    rewards = _as_rewards(rewards)
    n = rewards.numel()
    if failed_rollouts not in FAILED_POLICIES:
        raise ValueError(
            f"failed_rollouts must be one of {FAILED_POLICIES}, got {failed_rollouts!r}"
        )
    if states is None:
        failed = torch.zeros(n, dtype=torch.bool)
    else:
        if len(states) != n:
            raise ValueError(f"states has {len(states)} entries but there are {n} rewards")
        parsed = []
        for k, s in enumerate(states):
            try:
                st = RolloutState(s)
            except ValueError:
                known = ", ".join(x.value for x in RolloutState)
                raise ValueError(f"states[{k}] is {s!r}; known states: {known}") from None
            if not st.terminal:
                raise ValueError(
                    f"rollout {k} is in state {st.value!r}; only finished rollouts train"
                )
            parsed.append(st.infra_failure)
        failed = torch.tensor(parsed, dtype=torch.bool)
    missing = torch.isnan(rewards) & ~failed
    if missing.any():
        k = int(missing.nonzero()[0])
        raise ValueError(
            f"rollout {k} succeeded but has no reward (NaN); score it, or mark it failed to exclude it"
        )
    if failed_rollouts == "exclude":
        keep = ~failed
    else:
        keep = torch.ones(n, dtype=torch.bool)
        rewards = torch.where(failed, torch.zeros_like(rewards), rewards)
    kept = keep.nonzero().squeeze(1)
    if isinstance(group_ids, torch.Tensor):
        kept_groups = group_ids[kept]
    else:
        if len(group_ids) != n:
            raise ValueError(f"group_ids has {len(group_ids)} entries but there are {n} rewards")
        kept_groups = [group_ids[k] for k in kept.tolist()]
    adv_kept, metrics = _advantages(rewards[kept], kept_groups, estimator, eps)
    values = torch.zeros(n, dtype=torch.float32).index_copy_(0, kept, adv_kept)
    n_failed = int(failed.sum())
    metrics["n_excluded_failed"] = n_failed if failed_rollouts == "exclude" else 0
    metrics["n_failed_as_zero_reward"] = n_failed if failed_rollouts == "zero_reward" else 0
    return Advantages(values, keep, metrics)


def _constant_per_rollout(values, index, n_rollouts, names, what, show) -> torch.Tensor:
    """The value each rollout's rows share, [n_rollouts]; raises naming the rollout if they differ.

    NaN must be encoded by the caller (e.g. as +inf) so that it counts as a value of its own.
    """
    hi = torch.full((n_rollouts,), -torch.inf, dtype=values.dtype).scatter_reduce_(
        0, index, values, "amax"
    )
    lo = torch.full((n_rollouts,), torch.inf, dtype=values.dtype).scatter_reduce_(
        0, index, values, "amin"
    )
    bad = (hi != lo) & (hi >= lo)  # (rollouts without rows keep hi < lo)
    if bad.any():
        k = int(bad.nonzero()[0])
        seen = sorted({show(v) for v in values[index == k].tolist()}, key=str)
        raise ValueError(f"rollout {names[k]!r}: its rows carry different {what}: {seen}")
    return lo


def per_rollout(
    rollout_ids: Sequence[str],
    group_ids: Sequence[str],
    rewards: torch.Tensor | Sequence[float | None] | None = None,
) -> tuple[list[str], torch.Tensor, list[str], torch.Tensor | None]:
    """Collapse per-row values to per-rollout ones, checking that they agree.

    Returns (rollouts in order of first appearance, rollout index of each row [rows], group of each
    rollout, reward of each rollout [n_rollouts] float32 or None). Raises if the rows of one
    rollout carry two group ids or two rewards (NaN on one row and a number on another disagree).
    """
    n = len(rollout_ids)
    inverse, keys = _index(rollout_ids, n, "rollout_ids")
    group, gkeys = _index(group_ids, n, "group_ids")
    # Number rollouts in order of first appearance (np.unique sorts them).
    first = torch.full((len(keys),), n, dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(n), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    index = rank[inverse]
    rollouts = [keys[k] for k in order.tolist()]
    g = _constant_per_rollout(
        group.to(torch.float64),
        index,
        len(rollouts),
        rollouts,
        "group ids",
        lambda v: gkeys[int(v)],
    )
    rollout_groups = [gkeys[int(x)] for x in g.tolist()]
    rollout_rewards = None
    if rewards is not None:
        r = _as_rewards(rewards, n)
        coded = torch.where(torch.isnan(r), torch.full_like(r, torch.inf), r)
        lo = _constant_per_rollout(
            coded,
            index,
            len(rollouts),
            rollouts,
            "rewards",
            lambda v: None if v == float("inf") else v,
        )
        rollout_rewards = torch.where(
            torch.isinf(lo), torch.full_like(lo, float("nan")), lo
        ).float()
    return rollouts, index, rollout_groups, rollout_rewards


def batch_advantages(
    batch: TrainingBatch,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    failed_rollouts: str = "exclude",
) -> tuple[TrainingBatch, torch.Tensor, dict[str, float]]:
    """(batch without excluded rollouts, advantages of its rollouts [n_rollouts] float32, metrics).

    The group of a rollout is read from its rows (an error naming it if they disagree). A rollout
    with no rows (e.g. an agent that failed before its first model call) is dropped and counted in
    `n_excluded_no_rows`; failed / timed_out rollouts follow `failed_rollouts`.
    """
    n_r = batch.n_rollouts
    index = batch.rollout_index
    group, gkeys = _index(batch.group_ids, batch.n_rows, "group_ids")
    g = _constant_per_rollout(
        group.to(torch.float64), index, n_r, batch.rollouts, "group ids", lambda v: gkeys[int(v)]
    )
    has_rows = torch.isfinite(g)
    sub = has_rows.nonzero().squeeze(1).tolist()
    states = [batch.rollout_states[k] for k in sub] if batch.rollout_states else None
    result = rollout_advantages(
        batch.rewards[sub],
        [gkeys[int(g[k])] for k in sub],
        states,
        estimator=estimator,
        eps=eps,
        failed_rollouts=failed_rollouts,
    )
    keep = torch.zeros(n_r, dtype=torch.bool)
    keep[sub] = result.keep
    values = torch.zeros(n_r, dtype=torch.float32)
    values[sub] = result.values
    metrics = {**result.metrics, "n_excluded_no_rows": n_r - len(sub)}
    if bool(keep.all()):
        return batch, values, metrics
    kept_rows = keep[index].nonzero().squeeze(1)
    return batch.select_rows(kept_rows), values[keep], metrics


def broadcast_to_tokens(
    values: torch.Tensor, rollout_index: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """[rows, S] float32: values[rollout_index[i]] on the trained tokens of row i, 0 elsewhere."""
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, one per rollout, got shape {tuple(values.shape)}")
    if rollout_index.dim() != 1 or rollout_index.numel() != response_mask.shape[0]:
        raise ValueError(
            f"rollout_index must have one entry per row ({response_mask.shape[0]}), "
            f"got {tuple(rollout_index.shape)}"
        )
    if rollout_index.numel() and (
        int(rollout_index.min()) < 0 or int(rollout_index.max()) >= values.numel()
    ):
        raise ValueError(f"rollout_index values must be in [0, {values.numel()})")
    return values.to(torch.float32)[rollout_index][:, None] * response_mask
