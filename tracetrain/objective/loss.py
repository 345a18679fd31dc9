"""The loss of one optimizer update over weighted tokens (weights.py: w[i,t] = m[i,t] * s_i):

    L = sum_{i,t} w[i,t] * l[i,t],     l = ppo_surrogate + kl_coef * kl - entropy_coef * entropy

This file is the math, in plain torch, and runs on any device. On CPU, above a size,
`policy_loss` hands the same computation to a faster twin in loss_cpu.py (tested equal to the
plain version). On GPU the plain versions here run.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tracetrain import registry
from tracetrain.objective import loss_cpu
from tracetrain.objective.weights import RowWeights, as_mask

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
KL_ESTIMATORS = registry.KL_ESTIMATORS
register_kl = KL_ESTIMATORS.register


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
    (x = r - 1 - log r: k3 of the new policy against old_logprobs). `weights` is w [rows, S] or
    (mask [rows, S], s [rows]). The ratio is r = exp(clamp(logprobs - old_logprobs, -20, 20)).
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

    - logprobs [rows, S]: the current policy's log-probabilities (differentiable).
    - old_logprobs [rows, S]: the log-probabilities the ratio is taken against (constant).
    - advantages: [rows] (one per row, e.g. `adv[batch.rollout_index]`) or [rows, S] (constant).
    - weights: a [rows, S] tensor, or `RowWeights(mask, row_scales)` (as the trainer passes them;
      the CPU path then builds no [rows, S] weight tensor). All three terms use the same weights
      (invariant 5).
    - is_weights [rows, S]: importance weights v >= 0 (constant), see correction.py.
    - ref_logprobs [rows, S] with `kl_estimator` in KL_ESTIMATORS: KL(policy || reference) term;
      needed when kl_coef != 0, reported as a metric whenever given.
    - entropy [rows, S] (differentiable): the policy's entropy; needed when entropy_coef != 0.

    Gradients flow to `logprobs` and `entropy` only. Metrics are detached 0-d tensors (no host
    sync): pg_loss (the weighted sum of the surrogate), weight_mass (sum w), and weighted means
    sum(w x) / sum(w) of clip_frac (ratio clipped by any bound), dual_clip_frac, approx_kl
    (k3 of the new policy against old_logprobs), and kl_ref / entropy when given.

    The math is `policy_loss_sums`. On CPU from loss_cpu.LOSS_MIN tokens, or whenever
    `chunk_tokens` is given (its block size), loss_cpu.policy_loss_sums computes the same (with a
    KL estimator that has no derivative in loss_cpu.KL_GRADS, the plain version runs).
    """
    weights = _check_tensors(logprobs, old_logprobs, advantages, weights, is_weights, ref_logprobs, entropy)
    _check_options(clip_low, clip_high, dual_clip, kl_coef, entropy_coef, chunk_tokens)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if ref_logprobs is not None:
        KL_ESTIMATORS.resolve(kl_estimator)

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
    fast = ref_logprobs is None or kl_estimator in loss_cpu.KL_GRADS  # (a plugin's KL: plain)
    if fast and (chunk_tokens is not None or loss_cpu.loss_pays(logprobs)):
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
        raise ValueError("logprobs must be a 2-D float tensor [rows, S]")
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
