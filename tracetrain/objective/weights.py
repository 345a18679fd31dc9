"""Token weights from the aggregation mode: every rollout weighs the same, however many rows it spans.

Notation (docs/invariants.md): a mini-batch holds rollouts r = 1..R spread over rows
i = 1..B; m[i,t] marks trained tokens, T_i = sum_t m[i,t], T_r = sum_{i in r} T_i. Every mode is a
set of token weights w[i,t] = m[i,t] * s_i (the mask times one scale per row) and

    L = sum_{i,t} w[i,t] * l[i,t],     l = ppo_surrogate + kl_coef * kl - entropy_coef * entropy

| mode                      | s_i                 | mass sum(w) |
|---------------------------|---------------------|-------------|
| rollout-mean (default)    | 1 / (R * T_r(i))    | 1           |
| token-mean                | 1 / sum_i T_i       | 1           |
| seq-mean-token-mean       | 1 / (B * T_i)       | 1           |
| seq-mean-token-sum        | 1 / B               | mean T_i    |
| seq-mean-token-sum-norm   | 1 / (B * L_norm)    | mean T_i / L_norm |

R counts rollouts, never rows. Empty rows and rollouts (no trained token) get weight 0 and are not
counted in R or B: they carry no signal and must not dilute the others, so the mass of a mean mode
stays exactly 1 (and is 0, not NaN, when nothing at all is trained).

This file is the math in plain torch, on any device. On CPU, above a size, `row_token_counts`
hands the same count to loss_cpu.py (tested equal). The loss over these weights is loss.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tracetrain import registry
from tracetrain.objective import loss_cpu

# ---------------------------------------------------------------------------------------------
# Row token counts and rollout indices
# ---------------------------------------------------------------------------------------------


def row_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """T_i = sum_t m[i,t] as int64 [rows] of a bool mask (loss_cpu's on CPU: the same counts)."""
    return loss_cpu.row_token_counts(mask) if loss_cpu.counts_pay(mask) else mask.sum(1)


RolloutIds = Sequence[str] | torch.Tensor


def rollout_inverse(rollout_ids: RolloutIds, rows: int, device=None) -> tuple[torch.Tensor, int]:
    """(inverse, n): inverse[i] in [0, n) is the rollout of row i; equal ids share an index.

    `rollout_ids` is a list of str (one per row) or an int64 tensor of rollout indices (e.g.
    `TrainingBatch.rollout_index`). Rows of one rollout need not be adjacent.
    """
    if isinstance(rollout_ids, torch.Tensor):
        if rollout_ids.dim() != 1 or rollout_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"rollout_ids tensor must be 1-D int64 rollout indices, got shape "
                f"{tuple(rollout_ids.shape)} dtype {rollout_ids.dtype}"
            )
        if rollout_ids.numel() != rows:
            raise ValueError(
                f"rollout_ids has {rollout_ids.numel()} entries but the mask has {rows} rows"
            )
        uniq, inverse = torch.unique(rollout_ids, return_inverse=True)
        return inverse.to(device=device, dtype=torch.int64), uniq.numel()
    if isinstance(rollout_ids, str) or not isinstance(rollout_ids, Sequence):
        raise ValueError(
            f"rollout_ids must be a list of str or an int64 tensor, got {type(rollout_ids).__name__}"
        )
    if len(rollout_ids) != rows:
        raise ValueError(f"rollout_ids has {len(rollout_ids)} entries but the mask has {rows} rows")
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), 0
    if set(map(type, rollout_ids)) != {str}:
        bad = next(x for x in rollout_ids if type(x) is not str)
        raise ValueError(f"rollout_ids must all be str, found {bad!r} ({type(bad).__name__})")
    ids = np.asarray(rollout_ids)
    uniq, inverse = np.unique(ids, return_inverse=True)  # vectorized, in C
    return torch.from_numpy(inverse.astype(np.int64)).to(device), len(uniq)


# ---------------------------------------------------------------------------------------------
# Aggregation modes: one scale per row
# ---------------------------------------------------------------------------------------------

# A mode maps (T_i float [rows], rollout inverse [rows], n_rollouts, norm_length) -> s_i [rows].
ScaleFn = Callable[[torch.Tensor, torch.Tensor, int, float | None], torch.Tensor]
MODES = registry.LOSS_MODES  # aliases: per_rollout_mean (Agent Lightning's name for rollout-mean)
register_mode = MODES.register
NORM_MODES = {"seq-mean-token-sum-norm"}  # modes that need norm_length


def _inv_or_zero(denom: torch.Tensor) -> torch.Tensor:
    """1/denom where denom > 0, else 0 (an empty row or rollout gets no weight, and no NaN)."""
    return torch.where(denom > 0, 1.0 / denom.clamp(min=1e-30), torch.zeros_like(denom))


def _nonempty_rows(t_row: torch.Tensor) -> torch.Tensor:
    return (t_row > 0).sum().to(t_row.dtype)  # B, a 0-d tensor (no host sync)


@register_mode("rollout-mean")
def _rollout_mean(t_row, inverse, n_rollouts, norm_length):
    """s_i = 1 / (R * T_r): every rollout weighs 1/R, its tokens share that equally."""
    t_rollout = torch.zeros(n_rollouts, dtype=t_row.dtype, device=t_row.device)
    t_rollout.index_add_(0, inverse, t_row)
    n_nonempty = (t_rollout > 0).sum().to(t_row.dtype)  # R
    return _inv_or_zero(n_nonempty * t_rollout)[inverse] * (t_row > 0)


@register_mode("token-mean")
def _token_mean(t_row, inverse, n_rollouts, norm_length):
    """s_i = 1 / sum_i T_i: every token weighs the same; long rollouts weigh more."""
    return _inv_or_zero(t_row.sum()).expand_as(t_row) * (t_row > 0)


@register_mode("seq-mean-token-mean")
def _seq_mean_token_mean(t_row, inverse, n_rollouts, norm_length):
    """s_i = 1 / (B * T_i): every row weighs 1/B; a rollout cut into k rows weighs k/B."""
    return _inv_or_zero(_nonempty_rows(t_row) * t_row)


@register_mode("seq-mean-token-sum")
def _seq_mean_token_sum(t_row, inverse, n_rollouts, norm_length):
    """s_i = 1 / B: a row's token losses are summed, rows averaged."""
    return _inv_or_zero(_nonempty_rows(t_row)).expand_as(t_row) * (t_row > 0)


@register_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(t_row, inverse, n_rollouts, norm_length):
    """s_i = 1 / (B * L_norm), L_norm a fixed constant (Dr. GRPO)."""
    return _inv_or_zero(_nonempty_rows(t_row) * norm_length).expand_as(t_row) * (t_row > 0)


def _resolve_mode(mode: str, norm_length: float | None) -> str:
    name = MODES.resolve(mode)
    if name in NORM_MODES:
        if (
            isinstance(norm_length, bool)
            or not isinstance(norm_length, (int, float))
            or not math.isfinite(norm_length)
            or norm_length <= 0
        ):
            raise ValueError(
                f"mode {mode!r} needs norm_length > 0 (a token count), got {norm_length!r}"
            )
    elif norm_length is not None:
        raise ValueError(f"norm_length is only used by {sorted(NORM_MODES)}, not by mode {mode!r}")
    return name


def as_mask(mask: torch.Tensor, name: str = "response_mask") -> torch.Tensor:
    """A [rows, S] mask as bool: a bool tensor as is (the fast path); 0/1 integers or floats
    (verl's and Agent Lightning's masks are int64) as `mask != 0`. Any other value is an error
    naming its position; nothing is coerced."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_complex():
        what = (
            f"shape {tuple(mask.shape)} dtype {mask.dtype}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise ValueError(f"{name} must be a 2-D tensor [rows, S] of bool or 0/1, got {what}")
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)  # NaN included
    if bool(bad.any()):
        i, t = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name}[{i}, {t}] is {mask[i, t].item()!r}: a mask holds only 0 and 1 "
            f"(dtype {mask.dtype}), or bool"
        )
    return mask != 0


def row_scales(
    response_mask: torch.Tensor,
    rollout_ids: RolloutIds,
    *,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
) -> torch.Tensor:
    """s [rows] float32 such that the token weights are w[i,t] = response_mask[i,t] * s[i].

    Compute it once for a whole mini-batch (all micro-batches, all ranks): see minibatch.py.
    """
    response_mask = as_mask(response_mask)
    return scales_from_counts(
        row_token_counts(response_mask), rollout_ids, mode=mode, norm_length=norm_length
    )


def scales_from_counts(
    token_counts: torch.Tensor,
    rollout_ids: RolloutIds,
    *,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
) -> torch.Tensor:
    """`row_scales` from the rows' trained-token counts T_i [rows] (all a mode needs)."""
    if not isinstance(token_counts, torch.Tensor) or token_counts.dim() != 1:
        raise ValueError("token_counts must be a 1-D tensor [rows]")
    name = _resolve_mode(mode, norm_length)
    inverse, n_rollouts = rollout_inverse(rollout_ids, token_counts.numel(), token_counts.device)
    t_row = token_counts.to(torch.float32)
    return MODES[name](t_row, inverse, n_rollouts, norm_length).to(torch.float32)


def rollout_mass(
    response_mask: torch.Tensor, rollout_ids: RolloutIds, row_scales: torch.Tensor
) -> torch.Tensor:
    """[n_rollouts] each rollout's share of the update, sum_{i in r} T_i * s_i (1/R each in
    rollout-mean, however many rows the rollout spans); rollouts in `rollout_inverse` order."""
    response_mask = as_mask(response_mask)
    inverse, n = rollout_inverse(rollout_ids, response_mask.shape[0], response_mask.device)
    row_mass = row_token_counts(response_mask).to(row_scales.dtype) * row_scales
    return torch.zeros(n, dtype=row_scales.dtype, device=row_scales.device).index_add_(0, inverse, row_mass)


def token_weights(
    response_mask: torch.Tensor,
    rollout_ids: RolloutIds,
    *,
    mode: str = "rollout-mean",
    norm_length: float | None = None,
) -> torch.Tensor:
    """w [rows, S] float32 = response_mask * row_scales (materialized; the loss does not need it)."""
    response_mask = as_mask(response_mask)
    s = row_scales(response_mask, rollout_ids, mode=mode, norm_length=norm_length)
    return response_mask.view(torch.uint8) * s[:, None]  # (uint8: bool arithmetic is slow on CPU)


class RowWeights(NamedTuple):
    """Token weights kept factored: w[i,t] = mask[i,t] * scales[i] (no [rows, S] float tensor)."""

    mask: torch.Tensor  # [rows, S] bool (or 0/1 integers / floats: see as_mask)
    scales: torch.Tensor  # [rows] float
