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
transformers' sdpa. An attention that is more than softmax(q k^T) v (a logit soft-cap, gemma2's
`softcap`; attention sinks, gpt_oss's `s_aux`: a keyword the plain formula does not know) runs
what the model itself runs instead, prefill and decode: the attention its config named before the
engine's copy took this one (transformers' function of that name, or for eager the model's own
eager_attention_forward), so that the engine computes what the trainer does. Registered as ATTENTION
("tracetrain_grouped") with transformers' eager masks (additive float, [B, 1, S, L]); the local
engine's copies of the model use it (engines/precision.py).

The masks of sliding-window layers keep each query to the `window` positions up to its own,
counted in positions, not in cache columns: the local engine's cache keeps every token of a
sliding layer (engines/layers.py) and its rows may have masked columns between their tokens (a
prefix from the prefix cache, then the rest of the prompt: engines/prefill.py). A row's real
tokens are its positions 0, 1, 2, ... in column order, so a column's position is the count of
real columns up to it, less one, and the window is

    allowed(q, kv) = real(kv) and kv <= q and pos(q) - pos(kv) < window

which is transformers' sliding-window mask (kv > q - window, in columns) wherever a row's tokens
are contiguous.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    eager_mask,
    prepare_padding_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION = "tracetrain_grouped"
# attention keywords the plain formula may ignore (the mask carries the window)
_PLAIN = frozenset({"position_ids", "sliding_window", "use_cache", "output_attentions",
                    "output_router_logits", "is_causal", "cache_position"})


MODEL_ATTENTION = "_tracetrain_model_attention"  # (on an engine copy's config: the model's own)


def _own_attention(module: torch.nn.Module, kwargs: dict) -> Callable | None:
    """The attention the model itself runs (its config's, before the engine's copy took
    ATTENTION: its eager_attention_forward, or transformers' function of that name) when a
    keyword asks for more than the plain formula; None when none does."""
    if all(v is None or k in _PLAIN for k, v in kwargs.items()):
        return None
    name = getattr(getattr(module, "config", None), MODEL_ATTENTION, None) or "eager"
    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """(output [B, S, H, d], None) for query [B, H, S, d], key and value [B, K, L, d], mask
    [B, 1, S, >= L] additive or None; the formulas of the module docstring when S == 1."""
    own = _own_attention(module, kwargs)
    if own is not None:
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                   **kwargs)
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


def _window(positions: torch.Tensor, window: int) -> Callable:
    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

    return inner


def engine_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function: Callable = causal_mask_function,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                **kwargs) -> torch.Tensor:
    """transformers' eager mask; a sliding-window layer's (`local_size`: the window) windowed in
    positions (module docstring) where a 2D padding mask says which columns are real."""
    if local_size is not None and attention_mask is not None and kv_offset == 0:
        real = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        positions = real.long().cumsum(-1) - 1
        mask_function = and_masks(causal_mask_function, _window(positions, local_size))
    return eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                      attention_mask, local_size=local_size, **kwargs)


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, engine_mask)
