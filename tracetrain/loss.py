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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Row token counts and rollout indices
# ---------------------------------------------------------------------------------------------


# Work on CPU is cut into blocks small enough (< 32k elements, torch's intra-op grain) that torch
# runs each op on the calling thread; the blocks are spread over a few Python threads instead
# (torch releases the GIL inside ops). There is then no per-op barrier between threads, which
# otherwise stalls every op when the machine's cores are shared with other processes.
_GRAIN = 1 << 15


def map_blocks(fn: Callable[[int], object], starts: Sequence[int], device: torch.device) -> list:
    """[fn(a) for a in starts], on torch.get_num_threads() threads when on CPU."""
    workers = min(torch.get_num_threads(), len(starts)) if device.type == "cpu" else 1
    if workers <= 1:
        return [fn(a) for a in starts]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, starts))


def row_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """T_i = sum_t m[i,t] as int64 [rows], reading the bool mask once.

    torch's bool row-sum is slow on CPU (it widens every byte to int64). A bool is one byte holding
    0 or 1, so we sum the mask as int64 words instead: each word carries 8 byte lanes, and a lane
    that adds up at most 255 words cannot carry into its neighbour. Summing blocks of 128 words,
    then the 8 bytes of each block sum, gives the exact count (tested against `mask.sum(1)`).
    """
    rows, width = mask.shape
    if mask.device.type != "cpu":
        return mask.sum(1)
    counts = torch.empty(rows, dtype=torch.int64)
    step = max(1, _GRAIN // max(width // 8, 1))  # rows per block

    def block(a: int) -> None:
        counts[a : a + step] = _count_rows(mask[a : a + step])

    map_blocks(block, range(0, rows, step), mask.device)
    return counts


def _count_rows(mask: torch.Tensor) -> torch.Tensor:
    rows, width = mask.shape
    n_words = width // 8
    counts = torch.zeros(rows, dtype=torch.int64, device=mask.device)
    if n_words and rows:
        head = mask[:, : 8 * n_words]
        if not (
            head.is_contiguous()
            and head.stride(0) == 8 * n_words
            and head.storage_offset() % 8 == 0
        ):
            head = torch.empty(rows, 8 * n_words, dtype=torch.bool, device=mask.device).copy_(head)
        words = head.view(torch.int64)  # [rows, n_words]
        full = n_words // 128
        lanes = []
        if full:
            lanes.append(words[:, : 128 * full].view(rows, full, 128).sum(-1))  # lanes <= 128
        if n_words % 128:
            lanes.append(words[:, 128 * full :].sum(-1, keepdim=True))  # lanes <= 127
        lane_sums = torch.cat(lanes, dim=1).contiguous()  # [rows, blocks] int64, 8 lanes each
        counts += lane_sums.view(torch.uint8).view(rows, 8 * lane_sums.shape[1]).sum(-1)
    if width % 8:
        counts += mask[:, 8 * n_words :].sum(-1)
    return counts


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
# KL estimators: value and d value / d logprob, per token (Schulman's k1, k2, k3)
# ---------------------------------------------------------------------------------------------

KlFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
KL_ESTIMATORS: dict[str, KlFn] = {}


def register_kl(name: str) -> Callable[[KlFn], KlFn]:
    def deco(fn: KlFn) -> KlFn:
        KL_ESTIMATORS[name] = fn
        return fn

    return deco


@register_kl("k1")
def kl_k1(logprob: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k1 = logprob - ref; d/dlogprob = 1."""
    return logprob - ref, torch.ones_like(logprob)


@register_kl("k2")
def kl_k2(logprob: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k2 = (logprob - ref)^2 / 2; d/dlogprob = logprob - ref."""
    diff = logprob - ref
    return 0.5 * diff * diff, diff


@register_kl("k3")
def kl_k3(logprob: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k3 = exp(x) - x - 1 with x = ref - logprob clamped to [-20, 20], then k3 clamped to <= 10
    (as verl's low_var_kl); d/dlogprob = 1 - exp(x), and 0 where the clamp at 10 is active."""
    x = (ref - logprob).clamp_(-20.0, 20.0)
    e = x.exp()
    value = (e - x).sub_(1.0)
    grad = torch.rsub(e, 1.0).mul_(torch.le(value, 10.0, out=torch.empty_like(value)))
    return value.clamp_(max=10.0), grad


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------

# Per-block sums, in this order; metrics are built from their totals.
_SUMS = ("pg", "mass", "clip_mass", "dual_mass", "ratio_w", "logratio_w", "kl_w", "entropy_w")


class _Cfg(NamedTuple):
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_coef: float
    kl_fn: KlFn | None
    entropy_coef: float


def _block(lp, old, adv, w, isw, ref, ent, cfg: _Cfg, grad_out):
    """Sums (see _SUMS) of one block of rows; writes d loss / d logprob of the block to grad_out.

    Per token, with ratio r = exp(clamp(lp - old, -20, 20)), advantage A and IS weight v >= 0:
        surrogate = min(max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high)), |A| dual_clip) * v
    The outer min is dual-clip PPO: it only binds for A < 0 (for A >= 0 the max is <= 0), where it
    caps the loss of a token whose ratio blew up at |A| * dual_clip. The gradient is -A v r where
    the unclipped term -A r is the one selected (`kept`), else 0.
    """
    logratio = torch.sub(lp, old).clamp_(-20.0, 20.0)
    ratio = logratio.exp()
    nav = adv.mul(isw).neg_() if isw is not None else adv.neg()  # -A v
    unclipped = ratio * nav
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high).mul_(nav)
    surrogate = torch.maximum(unclipped, clipped, out=clipped)
    zero = w.new_zeros(())
    flag = torch.empty_like(w)  # a 0/1 float indicator, reused
    dual_w = zero
    if cfg.dual_clip is not None:
        cap = nav.abs().mul_(cfg.dual_clip)  # |A| v dual_clip
        dual_w = torch.dot(torch.gt(surrogate, cap, out=flag).view(-1), w.view(-1))
        surrogate = torch.minimum(surrogate, cap, out=surrogate)
    kept = torch.eq(surrogate, unclipped, out=flag)  # the gradient flows through r here
    sums = [
        torch.dot(surrogate.view(-1), w.view(-1)),
        zero,  # the mass, filled in by the caller
        torch.dot(torch.sub(1.0, kept).view(-1), w.view(-1)),  # clipped: exactly 0 when none is
        dual_w,
        torch.dot(ratio.view(-1), w.view(-1)),
        torch.dot(logratio.view(-1), w.view(-1)),
    ]
    grad = unclipped.mul_(kept)  # d surrogate / d lp, before the weights
    if cfg.kl_fn is not None:
        kl, dkl = cfg.kl_fn(lp, ref.float())
        sums.append(torch.dot(kl.view(-1), w.view(-1)))
        if cfg.kl_coef != 0.0:
            grad = grad.add_(dkl, alpha=cfg.kl_coef)
    else:
        sums.append(zero)
    torch.mul(grad, w, out=grad_out)
    sums.append(torch.dot(ent.float().view(-1), w.view(-1)) if ent is not None else zero)
    return torch.stack(sums)


class _PolicyLoss(torch.autograd.Function):
    """Blockwise forward that also computes d loss / d logprob, so backward is one multiply.

    The [rows, R] temporaries of the elementwise math exist only one block at a time and stay in
    cache; the only full-size tensor written is the gradient. Blocks run through `map_blocks`.
    """

    @staticmethod
    def forward(ctx, logprobs, entropy, old, adv, weights, mask, scales, isw, ref, cfg, chunk):
        rows, width = logprobs.shape
        grad = torch.empty(rows, width, dtype=torch.float32, device=logprobs.device)
        step = max(1, chunk // max(width, 1))
        per_row_adv = adv.dim() == 1

        @torch.no_grad()  # grad mode is per thread: the workers need it off too
        def block(a: int) -> torch.Tensor:
            b = min(a + step, rows)
            if weights is not None:
                w = weights[a:b].float()
            else:  # a bool tensor in arithmetic is slow on CPU; its uint8 view is not
                w = torch.mul(mask[a:b].view(torch.uint8), scales[a:b, None].float())
            sums = _block(
                logprobs[a:b].float(),
                old[a:b].float(),
                (adv[a:b, None] if per_row_adv else adv[a:b]).float(),
                w,
                None if isw is None else isw[a:b].float(),
                None if ref is None else ref[a:b],
                None if entropy is None else entropy[a:b],
                cfg,
                grad[a:b],
            )
            if weights is not None:
                sums[1] = w.sum()
            return sums

        parts = map_blocks(block, range(0, rows, step), logprobs.device)
        totals = torch.zeros(len(_SUMS), dtype=torch.float32, device=logprobs.device)
        if parts:
            totals = torch.stack(parts).sum(0)
        if weights is None:  # mass = sum_i s_i T_i, from the row counts
            totals[1] = torch.dot(scales.float(), row_token_counts(mask).float())
        ctx.save_for_backward(grad, weights, mask, scales)
        ctx.entropy_coef = cfg.entropy_coef
        ctx.lp_dtype = logprobs.dtype
        ctx.ent_dtype = None if entropy is None else entropy.dtype
        loss = totals[0] + cfg.kl_coef * totals[6] - cfg.entropy_coef * totals[7]
        ctx.mark_non_differentiable(totals)
        return loss, totals

    @staticmethod
    def backward(ctx, grad_loss, _grad_totals):
        grad, weights, mask, scales = ctx.saved_tensors
        grad_lp = (grad * grad_loss).to(ctx.lp_dtype) if ctx.needs_input_grad[0] else None
        grad_ent = None
        if ctx.needs_input_grad[1] and ctx.entropy_coef != 0.0:
            c = -ctx.entropy_coef * grad_loss
            w = (
                weights * c
                if weights is not None
                else mask.view(torch.uint8) * (scales[:, None] * c)
            )
            grad_ent = w.to(ctx.ent_dtype)
        return grad_lp, grad_ent, *([None] * 9)


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
    - weights: a [rows, R] tensor, or `RowWeights(mask, row_scales)` (the hot path: no [rows, R]
      weight tensor is built). All three terms use the same weights (invariant 5).
    - is_weights [rows, R]: truncated importance weights (constant), see `truncated_is_weights`.
    - ref_logprobs [rows, R] with `kl_estimator` in KL_ESTIMATORS: KL(policy || reference) term;
      needed when kl_coef != 0, reported as a metric whenever given.
    - entropy [rows, R] (differentiable): the policy's entropy; needed when entropy_coef != 0.

    Gradients flow to `logprobs` and `entropy` only. Metrics are detached 0-d tensors (no host
    sync): pg_loss (the weighted sum of the surrogate), weight_mass (sum w), and weighted means
    sum(w x) / sum(w) of clip_frac (ratio clipped by any bound), dual_clip_frac, approx_kl
    (k3 of the new policy against old_logprobs), and kl_ref / entropy when given.
    """
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
    if isinstance(weights, tuple):
        mask, scales = weights
        mask = as_mask(mask, "weights mask")
        if mask.shape != shape:
            raise ValueError(
                f"weights mask must have the shape of logprobs {tuple(shape)}, got {tuple(mask.shape)}"
            )
        if not isinstance(scales, torch.Tensor) or scales.shape != shape[:1]:
            got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(f"weights row scales must have shape {tuple(shape[:1])}, got {got}")
        full = None
        mask, scales = mask.contiguous(), scales.contiguous()
    else:
        _check_same_shape("weights", weights, shape)
        full, mask, scales = weights.contiguous(), None, None
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
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    kl_fn = None
    if ref_logprobs is not None:
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown kl_estimator {kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}"
            )
        kl_fn = KL_ESTIMATORS[kl_estimator]
    cfg = _Cfg(
        float(clip_low), float(clip_high), dual_clip, float(kl_coef), kl_fn, float(entropy_coef)
    )
    if chunk_tokens is None:
        chunk_tokens = _GRAIN if logprobs.device.type == "cpu" else 1 << 24

    def c(x):
        return None if x is None else x.detach().contiguous()

    loss, totals = _PolicyLoss.apply(
        logprobs.contiguous(),
        None if entropy is None else entropy.contiguous(),
        c(old_logprobs),
        c(advantages),
        None if full is None else full.detach(),
        mask,
        None if scales is None else scales.detach(),
        c(is_weights),
        c(ref_logprobs),
        cfg,
        chunk_tokens,
    )
    s = dict(zip(_SUMS, totals.unbind(0), strict=True))
    mass = s["mass"]
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))

    def mean(x):
        return torch.where(mass > 0, x / safe, torch.zeros_like(x))

    metrics = {
        "pg_loss": s["pg"],
        "weight_mass": mass,
        "clip_frac": mean(s["clip_mass"]),
        "dual_clip_frac": mean(s["dual_mass"]),
        "approx_kl": mean(s["ratio_w"] - mass - s["logratio_w"]),
    }
    if ref_logprobs is not None:
        metrics["kl_ref"] = mean(s["kl_w"])
    if entropy is not None:
        metrics["entropy"] = mean(s["entropy_w"])
    return loss, metrics


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, cap: float = 2.0
) -> torch.Tensor:
    """min(exp(old - rollout), cap), detached: truncated importance weights correcting for the
    inference engine's sampling distribution differing from the trainer's (TIS)."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    return (
        (old_logprobs.detach() - rollout_logprobs.detach()).clamp_(max=20.0).exp_().clamp_(max=cap)
    )
