"""A user's own module, as a config's `plugins` names it (tests/test_registry.py): it registers an
advantage estimator and a loss aggregation mode, and notes each call in the file named by
$PLUGIN_CALLS (one line: what was called, and the torch.distributed RANK or '-')."""

from __future__ import annotations

import os

import torch

from tracetrain.objective.advantage import register_estimator
from tracetrain.objective.weights import register_mode


def _note(what: str) -> None:
    path = os.environ.get("PLUGIN_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {os.environ.get('RANK', '-')}\n")


@register_estimator("sign")
def sign(rewards: torch.Tensor, group: torch.Tensor, n_groups: int, eps: float) -> torch.Tensor:
    """sign(x - mu_g): +1 above the group's mean, -1 below, 0 at it ([n] float64)."""
    _note("estimator")
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, rewards) / count
    return torch.sign(rewards - mean[group])


@register_mode("half-rollout-mean")
def half_rollout_mean(t_row: torch.Tensor, inverse: torch.Tensor, n_rollouts: int,
                      norm_length: float | None) -> torch.Tensor:
    """s_i = 1 / (2 R T_r): rollout-mean's weights halved, so an update's mass is 1/2 ([rows])."""
    _note("mode")
    t_rollout = torch.zeros(n_rollouts, dtype=t_row.dtype).index_add_(0, inverse, t_row)
    r = (t_rollout > 0).sum().to(t_row.dtype)
    per_rollout = torch.where(t_rollout > 0, 0.5 / (r * t_rollout).clamp(min=1e-30), 0.0)
    return per_rollout[inverse] * (t_row > 0)
