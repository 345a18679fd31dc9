"""The optimizer: torch's AdamW, with its fused kernel where the parameters' device has one, and
gradient clipping by the total norm.

Fused AdamW is the same update (decoupled weight decay, bias-corrected moments) in one kernel per
tensor instead of a dozen ops each (figures in docs/bench-train.md).
"""

from __future__ import annotations

import math

import torch


def adamw(params, **kw) -> torch.optim.AdamW:
    """torch.optim.AdamW(params, fused=True, **kw); unfused on a device or dtype without the kernel."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def lr_factor(step: int, *, warmup: int, total: int, decay: str) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warm-up, then decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * frac)) if decay == "cosine" else 1.0 - frac


def clip_grad_norm(params, max_norm: float) -> float:
    """torch's clip_grad_norm_: g <- g * min(1, max_norm / (|g| + 1e-6)) over the gradients of
    `params`, |g| their total 2-norm (returned), without the pass over every gradient where the
    factor is 1."""
    params = list(params)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if float(total) + 1e-6 > max_norm:  # (the factor min(1, ...) is 1 otherwise: g unchanged)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def optimizer_and_schedule(params, optim, steps: int):
    """(AdamW over `params` at optim.lr, its LambdaLR schedule): lr_factor per optimizer update,
    with `optim.ppo_epochs * optim.mini_batches` updates per training step over `steps` steps.
    `optim`: the run's OptimConfig (or a policy's, config `policies`)."""
    optimizer = adamw(params, lr=optim.lr, weight_decay=optim.weight_decay)
    per_step = optim.ppo_epochs * optim.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(
        k, warmup=optim.warmup_steps * per_step, total=steps * per_step, decay=optim.decay))
    return optimizer, scheduler
