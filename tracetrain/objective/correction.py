"""Importance corrections: the engine sampled each token from its own distribution (a policy some
versions old, or the same weights with other numerics); the update learns the trainer's.

Notation for one step's rows (docs/invariants.md): m[i,t] marks trained tokens, rows
i in rows(r) of rollout r, T_r = sum_{i in r, t} m[i,t].

    mu[i,t]    the behaviour log-probability the engine recorded (each turn's own model version)
    pi[i,t]    the trainer's, under the policy before the step's first update (the proximal policy)
    lr[i,t]    = pi[i,t] - mu[i,t]                           log rho, per token
    LR_r       = sum_{i in r, t} m[i,t] lr[i,t]              log of the rollout's ratio: the product
                                                             over all its trained tokens, all its rows
    G_r        = LR_r / T_r                                  log of its per-token geometric mean

Each correction is a function registered by name (`correction.weight`, `correction.mask`) that
gives v[i,t] >= 0; the loss multiplies the PPO surrogate of token (i,t) by v[i,t] (loss.py:
l(A v) = v l(A)); the token weights w, the KL and entropy terms are not touched (invariant 5 holds
for w). The decoupled form (AReaL): the PPO ratio is pi_theta / pi (`correction.old: trainer`) and
v corrects pi against mu.

| weight  | v[i,t]                        |                                               |
|---------|-------------------------------|-----------------------------------------------|
| none    | 1                             |                                               |
| token   | min(exp(lr[i,t]), C)          | token-level truncated IS (TIS)                |
| rollout | min(exp(LR_r), C)             | sequence-level TIS, the sequence = the rollout |

| mask    | v[i,t] multiplied by 0 where  |                                               |
|---------|-------------------------------|-----------------------------------------------|
| token   | exp(lr[i,t]) not in [lo, hi]  | masked IS, IcePop's band                      |
| rollout | exp(G_r) not in [lo, hi]      | the whole rollout                             |

`correction.reject: [lo, hi]`: a rollout with exp(G_r) outside it is taken out of the update
(its trained mask cleared before the token weights are made, so R counts the kept rollouts and the
mass of rollout-mean stays 1 over them), counted.

Everything per rollout is a sum over its rows (index_add by rollout index, in float64): the same
number whether the rollout is one row or k rows (invariant 9). v is computed once for the step's
rows, before mini-batches, micro-batches and ranks (invariant 3). With pi = mu every v is 1 and
nothing is masked or rejected: the loss is the uncorrected one, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from tracetrain import registry

# (log ratio [rows, S] float64 masked to 0 off m, per-token broadcast of LR_r and G_r [rows, S],
#  option) -> v [rows, S] float64
CorrectionFn = Callable[..., torch.Tensor]
WEIGHTS = registry.CORRECTION_WEIGHTS
MASKS = registry.CORRECTION_MASKS


def register(table: registry.Registry, name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    return table.register(name)


class LogRatios(NamedTuple):
    """log rho of one step's rows, per token and per rollout (module docstring)."""

    token: torch.Tensor  # [rows, S] float64: lr, 0 where m is 0
    rollout: torch.Tensor  # [n_rollouts] float64: LR_r
    geo: torch.Tensor  # [n_rollouts] float64: G_r (0 for a rollout without trained tokens)
    tokens: torch.Tensor  # [n_rollouts] int64: T_r


def log_ratios(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
               rollout_index: torch.Tensor, n_rollouts: int) -> LogRatios:
    """lr, LR_r, G_r and T_r from pi and mu [rows, S], mask m [rows, S] and rollout_index [rows]
    (rows of one rollout need not be adjacent)."""
    m = mask.bool()
    lr = torch.where(m, trainer_logprobs.double() - behaviour_logprobs.double(), 0.0)
    per_rollout = torch.zeros(n_rollouts, dtype=torch.float64).index_add_(0, rollout_index, lr.sum(1))
    tokens = torch.zeros(n_rollouts, dtype=torch.int64).index_add_(0, rollout_index, m.sum(1))
    geo = torch.where(tokens > 0, per_rollout / tokens.clamp(min=1), 0.0)
    return LogRatios(lr, per_rollout, geo, tokens)


@register(WEIGHTS, "none")
def weight_none(r: LogRatios, rollout_index: torch.Tensor, cap: float) -> torch.Tensor:
    """v = 1."""
    return torch.ones_like(r.token)


@register(WEIGHTS, "token")
def weight_token(r: LogRatios, rollout_index: torch.Tensor, cap: float) -> torch.Tensor:
    """v[i,t] = min(exp(lr[i,t]), C)."""
    return r.token.clamp(max=20.0).exp().clamp(max=cap)


@register(WEIGHTS, "rollout")
def weight_rollout(r: LogRatios, rollout_index: torch.Tensor, cap: float) -> torch.Tensor:
    """v[i,t] = min(exp(LR_r), C) for every token of rollout r, whichever row holds it."""
    v = r.rollout.clamp(max=20.0).exp().clamp(max=cap)
    return v[rollout_index][:, None].expand_as(r.token).clone()


def _outside(x: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    return (x < band[0]) | (x > band[1])


@register(MASKS, "none")
def mask_none(r: LogRatios, rollout_index: torch.Tensor, band) -> torch.Tensor:
    """keeps every token."""
    return torch.ones_like(r.token)


@register(MASKS, "token")
def mask_token(r: LogRatios, rollout_index: torch.Tensor, band) -> torch.Tensor:
    """0 where exp(lr[i,t]) is outside [lo, hi]."""
    return (~_outside(r.token.exp(), band)).double()


@register(MASKS, "rollout")
def mask_rollout(r: LogRatios, rollout_index: torch.Tensor, band) -> torch.Tensor:
    """0 on every token of a rollout whose exp(G_r) is outside [lo, hi]."""
    keep = ~_outside(r.geo.exp(), band)
    return keep[rollout_index][:, None].expand_as(r.token).double()


class Correction(NamedTuple):
    """What the update uses: v (None when every v is 1 by construction) and the trained mask with
    rejected rollouts cleared; and the metrics of the step."""

    is_weights: torch.Tensor | None  # [rows, S] float32
    mask: torch.Tensor  # [rows, S] bool
    metrics: dict[str, float]


def correct(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
            rollout_index: torch.Tensor, *, weight: str = "none", cap: float = 2.0,
            mask_mode: str = "none", band: tuple[float, float] = (0.5, 2.0),
            reject: tuple[float, float] | None = None) -> Correction:
    """v and the kept mask of one step's rows (module docstring); shapes as in `log_ratios`.

    metrics (correction/...): log_ratio_mean and abs_log_ratio_max over trained tokens (the
    engine-trainer gap), weight_mean and weight_max of v over kept trained tokens, capped_frac
    (tokens whose v was capped at C), masked_token_frac, masked_rollouts, rejected_rollouts."""
    WEIGHTS.resolve(weight)
    MASKS.resolve(mask_mode)
    m = mask.bool()
    n_rollouts = int(rollout_index.max()) + 1 if rollout_index.numel() else 0
    r = log_ratios(trainer_logprobs, behaviour_logprobs, m, rollout_index, n_rollouts)
    has_tokens = r.tokens > 0
    rejected = torch.zeros(n_rollouts, dtype=torch.bool)
    if reject is not None:
        rejected = _outside(r.geo.exp(), reject) & has_tokens
    kept = m & ~rejected[rollout_index][:, None]
    raw = WEIGHTS[weight](r, rollout_index, cap)
    capped = raw >= cap if weight != "none" else torch.zeros_like(kept)
    keep = MASKS[mask_mode](r, rollout_index, band)
    v = torch.where(kept, raw * keep, 0.0)
    n_kept = int(kept.sum())
    masked_tokens = kept & (keep == 0)
    masked_rollouts = torch.zeros(n_rollouts, dtype=torch.int64).index_add_(
        0, rollout_index, masked_tokens.sum(1)) > 0
    lr = r.token[m]
    metrics = {
        "correction/log_ratio_mean": float(lr.mean()) if lr.numel() else 0.0,
        "correction/abs_log_ratio_max": float(lr.abs().max()) if lr.numel() else 0.0,
        "correction/weight_mean": float(v[kept].mean()) if n_kept else 0.0,
        "correction/weight_max": float(v[kept].max()) if n_kept else 0.0,
        "correction/capped_frac": float((capped & kept).sum()) / max(1, n_kept),
        "correction/masked_token_frac": float(masked_tokens.sum()) / max(1, n_kept),
        "correction/masked_rollouts": int((masked_rollouts & ~rejected).sum()),
        "correction/rejected_rollouts": int(rejected.sum()),
    }
    identity = weight == "none" and mask_mode == "none"
    return Correction(None if identity else v.float(), kept, metrics)
