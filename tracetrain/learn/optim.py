"""The optimizer: torch's AdamW, with its fused kernel where the parameters' device has one.

Fused AdamW is the same update (decoupled weight decay, bias-corrected moments) in one kernel per
tensor instead of a dozen ops each (figures in docs/bench-train.md).
"""

from __future__ import annotations

import torch


def adamw(params, **kw) -> torch.optim.AdamW:
    """torch.optim.AdamW(params, fused=True, **kw); unfused on a device or dtype without the kernel."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def optimizer_and_schedule(params, optim, steps: int):
    """(AdamW over `params` at optim.lr, its LambdaLR schedule): lr_factor per optimizer update,
    with `optim.ppo_epochs * optim.mini_batches` updates per training step over `steps` steps.
    `optim`: the run's OptimConfig (or a policy's, config `policies`)."""
    from tracetrain.learn.update import lr_factor

    optimizer = adamw(params, lr=optim.lr, weight_decay=optim.weight_decay)
    per_step = optim.ppo_epochs * optim.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(
        k, warmup=optim.warmup_steps * per_step, total=steps * per_step, decay=optim.decay))
    return optimizer, scheduler
