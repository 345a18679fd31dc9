"""The pieces that the families' one-function decode steps share (engines/decode_graph.py), each in
the op order and dtypes of the transformers code it stands for, so that a step run eagerly gives
transformers' result bit for bit (the same kernels on the same shapes).

A step's attention masks are additive [B, C] over the KV stores' C columns (engines/kv_cache.py):
0 where a row attends, the dtype's lowest value elsewhere, as transformers' eager masks and the
engine's (engines/attention.py engine_mask). With `real` the columns that hold a row's tokens
(attention_mask [B, L + 1] of 0/1: the cache's L columns and the step's token at column L; the
columns past L are free) and pos(c) = (real columns up to c) - 1 the position of column c's token:

    full attention     allowed(c) = real(c)
    sliding window     allowed(c) = real(c) and pos(L) - pos(c) < window

(a sliding layer keeps every token, its window kept by the mask, counted in positions: the engine's
sliding mask at a decode step, where the query is column L).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] or None) of `module`."""
    return module.weight, module.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over x's last dim, the mean in float32, cast back before
    the weight (transformers' LlamaRMSNorm; Qwen3's q_norm/k_norm over a head's d)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / sqrt(mean(x^2) + eps) * (1 + weight)) over x's last dim, all in float32, cast back to
    x's dtype at the end (transformers' Gemma3RMSNorm)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, 1, d] in `dtype` of the angles p f, (f, f) concatenated, in float32, for
    positions [B] int64 and inv_freq f [d/2] (transformers' default RoPE, attention_scaling 1)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    angles = torch.cat((freqs, freqs), -1)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rotate_half(x) = (-x[d/2:], x[:d/2]); x [B, heads, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
           col: torch.Tensor, mask: torch.Tensor, scaling: float, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """The attention output [B, H d] (before o_proj) of one decode step: q [B, H, d], k and v
    [B, K, 1, d] before RoPE; rope(k) and v written into the stores kc, vc [B, K, C, d] at column
    col [1] (in place); then by grouped matmuls (engines/attention.py, G = H / K)

        s = rope(q) [B, K, G, d] @ kc^T * scaling + mask [B, 1, 1, C]
        out = softmax(s) in float32, cast to q's dtype, @ vc              [B, K, G, d]
    """
    B, H, d = q.shape
    K = kc.shape[1]
    q = rope(q, cos, sin)
    kc.index_copy_(2, col, rope(k, cos[:, None], sin[:, None]))
    vc.index_copy_(2, col, v)
    scores = torch.matmul(q.view(B, K, H // K, d), kc.transpose(2, 3)) * scaling
    scores = scores + mask[:, None, None, :]
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), vc).reshape(
        B, H * d)


def masks(attention_mask: torch.Tensor, columns: int, dtype: torch.dtype, window: int | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(full, sliding) additive masks [B, columns] in `dtype` (module docstring) for attention_mask
    [B, L + 1] of 0/1; sliding is None where `window` is (no sliding layer)."""
    B, n = attention_mask.shape
    real = attention_mask.bool()
    low = torch.finfo(dtype).min
    full = torch.full((B, columns), low, dtype=dtype, device=attention_mask.device)
    full[:, :n].masked_fill_(real, 0.0)
    if window is None:
        return full, None
    pos = real.long().cumsum(-1) - 1
    sliding = torch.full((B, columns), low, dtype=dtype, device=attention_mask.device)
    sliding[:, :n].masked_fill_(real & (pos[:, -1:] - pos < window), 0.0)
    return full, sliding


def swiglu(a: torch.Tensor, wg: torch.Tensor, bg: torch.Tensor | None, wu: torch.Tensor,
           bu: torch.Tensor | None, wd: torch.Tensor, bd: torch.Tensor | None) -> torch.Tensor:
    """(silu(a Wg + bg) * (a Wu + bu)) Wd + bd: transformers' Llama MLP, a [B, h] -> [B, h]."""
    return F.linear(F.silu(F.linear(a, wg, bg)) * F.linear(a, wu, bu), wd, bd)
