"""Decode attention by grouped matmuls: a decode step's attention without copying the KV cache.

One decode step has one query token per row. With grouped-query attention (H query heads, K kv
heads, G = H / K; query head h reads kv head h // G, transformers' repeat_kv order) the G query
heads of a kv head are one [G, d] block against that head's keys:

    q       [B, H, 1, d]  ->  [B, K, G, d]          (a view: heads k*G .. k*G + G - 1)
    s       = q @ k^T * scaling + mask                 [B, K, G, L]   (mask [B, 1, 1, L], additive)
    w       = softmax(s) in float32, back to q's dtype
    out     = w @ v                                    [B, K, G, d]  ->  [B, 1, H, d]

which is eager attention's arithmetic (transformers' eager_attention_forward) without repeat_kv's
copies of the cache's keys and values (G copies per layer and step), and without the fused CPU
kernel that is slow for one query in bfloat16 (F.scaled_dot_product_attention: bench
docs/benchmarks.md "Engine precision"). A pass with several query tokens (a prefill) goes to
transformers' sdpa. Registered as ATTENTION ("tracetrain_grouped") with transformers' eager
masks (additive float, [B, 1, S, L]); the local engine's bf16 copy uses it (engines/precision.py).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

ATTENTION = "tracetrain_grouped"


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """(output [B, S, H, d], None) for query [B, H, S, d], key and value [B, K, L, d], mask
    [B, 1, S, >= L] additive or None; the formulas of the module docstring when S == 1."""
    B, H, S, d = query.shape
    if S > 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    K = key.shape[1]
    q = query.reshape(B, K, H // K, d)
    scores = torch.matmul(q, key.transpose(2, 3)) * (d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, value).reshape(B, H, 1, d).transpose(1, 2), None


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)
