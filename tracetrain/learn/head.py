"""The lm head's logprobs with their gradient written out: no [M, V] tensor kept, and the backward
a handful of passes over each chunk's logits instead of autograd's dozen.

For hidden states h [M, H], the head W [V, H] (bias b [V] or none), targets y [M], temperature T:

    z[m]      = (h[m] @ W.T + b) / T                        [V], one chunk of rows at a time
    lse[m]    = logsumexp(z[m])
    lp[m]     = z[m, y_m] - lse[m]
    dlp/dz[m] = onehot(y_m) - softmax(z[m])

so with g = dL/dlp [M]:  dz = g (onehot(y) - exp(z - lse)) / T,  dh = dz @ W,  dW = dz.T @ h,
db = sum_m dz[m]. The forward keeps h, y and lse, and the logits as the matmul gave them (bf16
under autocast) where they take at most KEEP_LOGITS_MB; else the backward computes each chunk's z
again (one matmul). dz is made in place from z. Under autocast (trainer.precision bf16-mixed) the
matmuls run in bf16 as the forward's did (the backward runs under the forward's autocast state),
z, lse and dz in fp32; dW and db are summed over the chunks in fp32. W is cast to the matmul's
dtype once, in the forward, and that copy kept for the backward.
"""

from __future__ import annotations

import torch
from torch.nn.functional import linear

KEEP_LOGITS_MB = 256  # the logits the forward keeps for the backward, at most (0: recompute them)


def _scaled(raw: torch.Tensor, temperature: float, *, keep_raw: bool = False) -> torch.Tensor:
    """z = raw / T in fp32; raw (the matmul's output) left as it is with `keep_raw`, else an fp32
    raw may be divided in place and returned."""
    scaled = temperature > 0 and temperature != 1.0
    z = raw.float() if raw.dtype != torch.float32 or not (keep_raw and scaled) else raw.clone()
    if scaled:
        z.div_(temperature)
    return z


class HeadLogprobs(torch.autograd.Function):
    """lp [M] fp32 = HeadLogprobs.apply(h [M, H], weight [V, H], bias [V] | None, y [M] int64,
    temperature, chunk): the module docstring's lp, `chunk` rows of logits at a time."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, h, weight, bias, target, temperature: float, chunk: int):
        lps, lses, kept = [], [], []
        low_w = weight.to(_matmul_dtype(h, weight))  # cast once, kept for the backward
        backward = any(ctx.needs_input_grad[:3])  # (none to come: nothing kept)
        keep = backward and h.shape[0] * weight.shape[0] * low_w.element_size() <= KEEP_LOGITS_MB * 2**20
        for s in range(0, h.shape[0], chunk):
            raw = linear(h[s : s + chunk], low_w, bias)
            z = _scaled(raw, temperature, keep_raw=keep)
            lse = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(-1, target[s : s + chunk, None]).squeeze(-1) - lse)
            lses.append(lse)
            if keep:
                kept.append(raw)
        lse = torch.cat(lses) if lses else h.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.temperature, ctx.chunk, ctx.kept = temperature, chunk, kept if keep else None
        ctx.low_w = low_w if backward else None
        return torch.cat(lps) if lps else lse.clone()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        h, weight, bias, target, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        scale = 1.0 / T if T > 0 and T != 1.0 else 1.0
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = None  # the first chunk's product, then the others added (no [V, H] of zeros first)
        db = None if bias is None or not ctx.needs_input_grad[2] else torch.zeros(bias.shape)
        g = g.float()
        low_w, ctx.low_w = ctx.low_w, None
        kept, ctx.kept = ctx.kept, None
        for i, s in enumerate(range(0, h.shape[0], chunk)):
            rows, gs = slice(s, s + chunk), g[s : s + chunk, None]
            dz = _scaled(kept[i] if kept else linear(h[rows], low_w, bias), T)
            dz.sub_(lse[rows, None]).exp_().mul_(-gs)  # -g softmax(z)
            dz.scatter_add_(1, target[rows, None], gs)  # + g onehot(y)
            if scale != 1.0:
                dz.mul_(scale)
            low = dz.to(low_w.dtype)
            if dh is not None:
                dh[rows] = (low @ low_w).to(dh.dtype)
            if ctx.needs_input_grad[1]:
                part = low.T @ h[rows].to(low.dtype)
                dw = part.float() if dw is None else dw.add_(part)
            if db is not None:
                db.add_(dz.sum(0))
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None)


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the forward's matmul ran in: autocast's where it is on, else the operands'."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return torch.promote_types(h.dtype, weight.dtype)


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, target: torch.Tensor, *,
                  temperature: float = 1.0, chunk: int = 512) -> torch.Tensor:
    """hidden [M, H], target [M] -> logprob [M] fp32 (HeadLogprobs, `chunk` rows at a time)."""
    return HeadLogprobs.apply(hidden, head.weight, head.bias, target, temperature, max(1, chunk))
