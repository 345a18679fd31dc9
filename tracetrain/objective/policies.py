"""Several policies in one update: each policy p learns from its own trained tokens only, and each
rollout holding such tokens weighs 1/R_p in p's loss (docs/invariants.md 11 and 12).

    m_p[i,t] = m[i,t] * [policy[i,t] = p]        policy p's trained tokens ([rows, S] bool)
    R_p      = #{rollouts r : sum_{i in r, t} m_p[i,t] > 0}
    s_p[i]   = row_scales(m_p, rollouts, mode)    the single-policy math (weights.py) on m_p
    w_p      = m_p * s_p                          rollout-mean: sum_{(i,t) in r} w_p[i,t] = 1/R_p

`policy[i,t]` is the index of the policy that made token t of row i (the policy of its turn's
role), -1 where no policy trains. A row may hold tokens of several policies (a trajectory row over
the turns of two roles): each policy weighs only its own. Everything about p is a function of m_p
and the rollout ids: the tokens of a policy q != p change neither m_p, R_p nor s_p (isolation),
and with a single policy m_0 = m, so w_0 is the single-policy weights bit for bit (reduction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tracetrain.objective.weights import RolloutIds, RowWeights, as_mask, row_scales


def policy_masks(mask: torch.Tensor, token_policy: torch.Tensor, n_policies: int) -> list[torch.Tensor]:
    """[m_p for p in 0..n_policies-1], each [rows, S] bool: the trained tokens of policy p.

    mask: [rows, S] trained tokens; token_policy: [rows, S] integer, the policy index of each token
    (-1: none). A trained token must belong to a policy (ValueError otherwise)."""
    mask = as_mask(mask)
    if token_policy.shape != mask.shape:
        raise ValueError(f"token_policy has shape {tuple(token_policy.shape)}, the mask "
                         f"{tuple(mask.shape)}: one policy index per token")
    if token_policy.dtype.is_floating_point or token_policy.dtype == torch.bool:
        raise ValueError(f"token_policy must hold integer policy indices, got {token_policy.dtype}")
    trained = token_policy[mask]
    if trained.numel() and (int(trained.min()) < 0 or int(trained.max()) >= n_policies):
        raise ValueError(f"a trained token has policy index outside 0..{n_policies - 1} "
                         f"(found {int(trained.min())}..{int(trained.max())})")
    return [mask & (token_policy == p) for p in range(n_policies)]


def policy_row_weights(
    mask: torch.Tensor,
    token_policy: torch.Tensor,
    rollout_ids: RolloutIds,
    policies: Sequence[str],
    *,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
) -> dict[str, RowWeights]:
    """{policy name: RowWeights(m_p, s_p)}: each policy's token weights, kept factored (rows
    [rows] scales), computed over the whole mini-batch as the single-policy weights are."""
    masks = policy_masks(mask, token_policy, len(policies))
    return {name: RowWeights(m, row_scales(m, rollout_ids, mode=mode, norm_length=norm_length))
            for name, m in zip(policies, masks, strict=True)}


def rollouts_of_policy(mask_p: torch.Tensor, rollout_ids: RolloutIds) -> int:
    """R_p: how many rollouts hold a trained token of the policy whose mask is `mask_p`."""
    from tracetrain.objective.weights import rollout_inverse

    mask_p = as_mask(mask_p)
    inverse, n = rollout_inverse(rollout_ids, mask_p.shape[0], mask_p.device)
    per_rollout = torch.zeros(n, dtype=torch.int64).index_add_(0, inverse.cpu(), mask_p.sum(1).cpu())
    return int((per_rollout > 0).sum())
