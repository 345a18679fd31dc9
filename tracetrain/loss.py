"""The loss of one optimizer update: token weights from the aggregation mode, then the PPO objective.

Notation (DESIGN.md, "Loss accounting"): a mini-batch holds rollouts r = 1..R spread over rows
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

This file is the math, in plain torch, and runs on any device. On CPU, above a size, two functions
hand the same computation to a faster twin in loss_cpu.py (tested equal to the plain version):
`row_token_counts` and `policy_loss`. On GPU the plain versions here run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tracetrain import loss_cpu

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
MODES: dict[str, ScaleFn] = {}
MODE_ALIASES = {"per_rollout_mean": "rollout-mean"}  # Agent Lightning's name for rollout-mean
NORM_MODES = {"seq-mean-token-sum-norm"}  # modes that need norm_length


def register_mode(name: str) -> Callable[[ScaleFn], ScaleFn]:
    def deco(fn: ScaleFn) -> ScaleFn:
        MODES[name] = fn
        return fn

    return deco


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
    name = MODE_ALIASES.get(mode, mode)
    if name not in MODES:
        known = ", ".join(list(MODES) + list(MODE_ALIASES))
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known modes: {known}")
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
    """A [rows, R] mask as bool: a bool tensor as is (the fast path); 0/1 integers or floats
    (verl's and Agent Lightning's masks are int64) as `mask != 0`. Any other value is an error
    naming its position; nothing is coerced."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_complex():
        what = (
            f"shape {tuple(mask.shape)} dtype {mask.dtype}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise ValueError(f"{name} must be a 2-D tensor [rows, R] of bool or 0/1, got {what}")
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
    """w [rows, R] float32 = response_mask * row_scales (materialized; the loss does not need it)."""
    response_mask = as_mask(response_mask)
    s = row_scales(response_mask, rollout_ids, mode=mode, norm_length=norm_length)
    return response_mask.view(torch.uint8) * s[:, None]  # (uint8: bool arithmetic is slow on CPU)


class RowWeights(NamedTuple):
    """Token weights kept factored: w[i,t] = mask[i,t] * scales[i] (no [rows, R] float tensor)."""

    mask: torch.Tensor  # [rows, R] bool (or 0/1 integers / floats: see as_mask)
    scales: torch.Tensor  # [rows] float


# ---------------------------------------------------------------------------------------------
# Per-token terms: PPO surrogate, KL to a reference (Schulman's k1, k2, k3)
# ---------------------------------------------------------------------------------------------


def ppo_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(l, clipped, dual) per token, with ratio r and advantage A:

        l = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high)),  then  min(l, |A| dual_clip)

    The min is dual-clip PPO: it binds only for A < 0 (for A >= 0, l <= 0) and caps the loss of a
    token whose ratio blew up. `clipped` marks tokens where a bound set l (no gradient through r
    there), `dual` those where the dual clip did.
    """
    unclipped = -advantages * ratio
    loss = torch.maximum(unclipped, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = advantages.abs() * dual_clip
        dual = loss > cap
        loss = torch.minimum(loss, cap)
    return loss, loss != unclipped, dual


KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KlFn] = {}


def register_kl(name: str) -> Callable[[KlFn], KlFn]:
    def deco(fn: KlFn) -> KlFn:
        KL_ESTIMATORS[name] = fn
        return fn

    return deco


@register_kl("k1")
def kl_k1(logprob: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k1 = logprob - ref."""
    return logprob - ref


@register_kl("k2")
def kl_k2(logprob: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k2 = (logprob - ref)^2 / 2."""
    return 0.5 * (logprob - ref) ** 2


@register_kl("k3")
def kl_k3(logprob: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) - x - 1 with x = ref - logprob clamped to [-20, 20], then clamped to <= 10
    (verl's low_var_kl)."""
    x = torch.clamp(ref - logprob, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1, max=10.0)


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------

SUMS = ("pg", "mass", "clip", "dual_clip", "approx_kl", "kl_ref", "entropy")


def policy_loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    is_weights: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    kl_estimator: str,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, sums) in float32, each sum sum_{i,t} w[i,t] x[i,t] of a per-token x (SUMS):

        L = pg + kl_coef * kl_ref - entropy_coef * entropy      (x = l, kl, H)

    and, detached, mass (x = 1), clip / dual_clip (x = the flags of ppo_surrogate), approx_kl
    (x = r - 1 - log r: k3 of the new policy against old_logprobs). `weights` is w [rows, R] or
    (mask [rows, R], s [rows]). The ratio is r = exp(clamp(logprobs - old_logprobs, -20, 20)).
    """
    w = weights.float() if isinstance(weights, torch.Tensor) else weights[0] * weights[1][:, None].float()
    adv = advantages.float()[:, None] if advantages.dim() == 1 else advantages.float()
    if is_weights is not None:  # an IS weight v >= 0 scales a token's loss: l(A v) = v l(A)
        adv = adv * is_weights.float()
    logprobs = logprobs.float()
    logratio = torch.clamp(logprobs - old_logprobs.float(), -20.0, 20.0)
    ratio = torch.exp(logratio)
    pg, clipped, dual = ppo_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    kl = None if ref_logprobs is None else KL_ESTIMATORS[kl_estimator](logprobs, ref_logprobs.float())
    entropy = None if entropy is None else entropy.float()

    def wsum(x: torch.Tensor | None) -> torch.Tensor:
        return w.new_zeros(()) if x is None else (w * x).sum()

    sums = {"pg": wsum(pg), "kl_ref": wsum(kl), "entropy": wsum(entropy)}
    loss = sums["pg"]  # (a term with coefficient 0 stays out of the graph: no gradient at all)
    if kl_coef != 0.0:
        loss = loss + kl_coef * sums["kl_ref"]
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * sums["entropy"]
    with torch.no_grad():
        sums["mass"] = w.sum()
        sums["clip"], sums["dual_clip"] = wsum(clipped), wsum(dual)
        sums["approx_kl"] = wsum(ratio - 1 - logratio)
    return loss, {k: sums[k].detach() for k in SUMS}


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | RowWeights | tuple[torch.Tensor, torch.Tensor],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = sum_{i,t} w[i,t] * (surrogate[i,t] * isw[i,t] + kl_coef * kl[i,t] - entropy_coef * H[i,t]).

    - logprobs [rows, R]: the current policy's log-probabilities (differentiable).
    - old_logprobs [rows, R]: the log-probabilities the ratio is taken against (constant).
    - advantages: [rows] (one per row, e.g. `adv[batch.rollout_index]`) or [rows, R] (constant).
    - weights: a [rows, R] tensor, or `RowWeights(mask, row_scales)` (as the trainer passes them;
      the CPU path then builds no [rows, R] weight tensor). All three terms use the same weights
      (invariant 5).
    - is_weights [rows, R]: importance weights v >= 0 (constant), see correction.py.
    - ref_logprobs [rows, R] with `kl_estimator` in KL_ESTIMATORS: KL(policy || reference) term;
      needed when kl_coef != 0, reported as a metric whenever given.
    - entropy [rows, R] (differentiable): the policy's entropy; needed when entropy_coef != 0.

    Gradients flow to `logprobs` and `entropy` only. Metrics are detached 0-d tensors (no host
    sync): pg_loss (the weighted sum of the surrogate), weight_mass (sum w), and weighted means
    sum(w x) / sum(w) of clip_frac (ratio clipped by any bound), dual_clip_frac, approx_kl
    (k3 of the new policy against old_logprobs), and kl_ref / entropy when given.

    The math is `policy_loss_sums`. On CPU from loss_cpu.LOSS_MIN tokens, or whenever
    `chunk_tokens` is given (its block size), loss_cpu.policy_loss_sums computes the same.
    """
    weights = _check_tensors(logprobs, old_logprobs, advantages, weights, is_weights, ref_logprobs, entropy)
    _check_options(clip_low, clip_high, dual_clip, kl_coef, entropy_coef, chunk_tokens)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if ref_logprobs is not None and kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}")

    def const(x):  # the gradient flows to logprobs and entropy only
        return None if x is None else x.detach()

    args = (logprobs, old_logprobs.detach(), advantages.detach(), weights)
    kw = dict(
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        dual_clip=None if dual_clip is None else float(dual_clip),
        is_weights=const(is_weights),
        ref_logprobs=const(ref_logprobs),
        kl_estimator=kl_estimator,
        kl_coef=float(kl_coef),
        entropy=entropy,
        entropy_coef=float(entropy_coef),
    )
    if chunk_tokens is not None or loss_cpu.loss_pays(logprobs):
        loss, s = loss_cpu.policy_loss_sums(*args, **kw, chunk_tokens=chunk_tokens or loss_cpu.BLOCK)
    else:
        loss, s = policy_loss_sums(*args, **kw)
    mass = s["mass"]
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))

    def mean(x):
        return torch.where(mass > 0, x / safe, torch.zeros_like(x))

    metrics = {
        "pg_loss": s["pg"],
        "weight_mass": mass,
        "clip_frac": mean(s["clip"]),
        "dual_clip_frac": mean(s["dual_clip"]),
        "approx_kl": mean(s["approx_kl"]),
    }
    if ref_logprobs is not None:
        metrics["kl_ref"] = mean(s["kl_ref"])
    if entropy is not None:
        metrics["entropy"] = mean(s["entropy"])
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Argument checks of policy_loss
# ---------------------------------------------------------------------------------------------


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_same_shape(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or x.shape != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {got}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a float tensor, got {x.dtype}")


def _check_tensors(logprobs, old_logprobs, advantages, weights, is_weights, ref_logprobs, entropy):
    """Shapes and dtypes; returns the weights detached, as a tensor or (bool mask, scales)."""
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError("logprobs must be a 2-D float tensor [rows, R]")
    shape = logprobs.shape
    _check_same_shape("logprobs", logprobs, shape)
    _check_same_shape("old_logprobs", old_logprobs, shape)
    _check_same_shape("is_weights", is_weights, shape)
    _check_same_shape("ref_logprobs", ref_logprobs, shape)
    _check_same_shape("entropy", entropy, shape)
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in (shape, shape[:1]):
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(
            f"advantages must have shape [rows] {tuple(shape[:1])} or {tuple(shape)}, got {got}"
        )
    if not isinstance(weights, tuple):
        _check_same_shape("weights", weights, shape)
        return weights.detach()
    mask, scales = weights
    mask = as_mask(mask, "weights mask")
    if mask.shape != shape:
        raise ValueError(
            f"weights mask must have the shape of logprobs {tuple(shape)}, got {tuple(mask.shape)}"
        )
    if not isinstance(scales, torch.Tensor) or scales.shape != shape[:1]:
        got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"weights row scales must have shape {tuple(shape[:1])}, got {got}")
    return mask, scales.detach()


def _check_options(clip_low, clip_high, dual_clip, kl_coef, entropy_coef, chunk_tokens):
    for name, v in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not (_is_number(v) and v >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    for name, v in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not _is_number(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if chunk_tokens is not None and (type(chunk_tokens) is not int or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
    if clip_low >= 1.0:
        raise ValueError(
            f"clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), got {clip_low}"
        )
    if dual_clip is not None and not (_is_number(dual_clip) and dual_clip > 1.0):
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
