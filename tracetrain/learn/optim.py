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
