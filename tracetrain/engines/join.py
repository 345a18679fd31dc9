"""Continuous batching: requests that arrive while a batch decodes join it at its next step.

A decoding batch of B rows holds, per layer, a KV cache [B, K, L, d] and a mask [B, L] (1: a real
token), each row's tokens right-aligned (the padding of its prompt on the left, masked). New
requests are prefilled on their own (engines/prefill.py, the prefix cache included) into a cache
[N, K, L', d] and a mask [N, L']; the two are joined row-wise, both right-aligned in
M = max(L, L') columns:

    keys   [B + N, K, M, d]  = cat(pad_left(keys_a, M - L), pad_left(keys_b, M - L'))   (zeros)
    mask   [B + N, M]        = cat(pad_left(mask_a, M - L), pad_left(mask_b, M - L'))   (0)

A padded column is masked out of every row's attention (its weight exp(-inf) = 0) and positions
are per row (position_ids), so each row's logits are those of its own tokens: a request that joins
gets the tokens it would get alone (its seeded draws are per (seed, token index): engines/
sampling.py), up to the rounding of matmuls of another batch shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tracetrain.engines.layers import CONV, FULL, ConvLayer, empty_cache, is_kv


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`t` with `n` zeros before its entries along `dim` (-1 or -2)."""
    if n == 0:
        return t
    return F.pad(t, (n, 0) if dim == -1 else (0, 0, n, 0))


def join_rows(cache: DynamicCache, mask: torch.Tensor, new_cache: DynamicCache,
              new_mask: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """(cache [B + N, K, M, d] per layer, mask [B + N, M]): `cache` and `mask` ([B, L]) with the
    rows of `new_cache` and `new_mask` ([N, L']) after them, M = max(L, L') (module docstring).
    A conv layer's state (engines/layers.py) has no columns: its rows are joined as they are."""
    L, Ln = mask.shape[-1], new_mask.shape[-1]
    M = max(L, Ln)
    layers = [
        tuple(torch.cat([_pad_left(a, M - L, -2), _pad_left(b, M - Ln, -2)])
              for a, b in ((la.keys, lb.keys), (la.values, lb.values)))
        if is_kv(la) else ConvLayer.joined(la, lb)
        for la, lb in zip(cache.layers, new_cache.layers, strict=True)
    ]
    return _cache(layers), torch.cat([_pad_left(mask, M - L, -1), _pad_left(new_mask, M - Ln, -1)])


def _cache(layers: list) -> DynamicCache:
    """A cache of attention layers' (keys, values) and conv layers (as they are)."""
    if all(isinstance(x, tuple) for x in layers):
        return DynamicCache(layers)
    cache = empty_cache([CONV if isinstance(x, ConvLayer) else FULL for x in layers])
    for i, x in enumerate(layers):
        if isinstance(x, tuple):
            cache.layers[i].update(*x)
        else:
            cache.layers[i] = x
    return cache
