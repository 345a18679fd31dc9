"""The decode's KV cache: each layer's keys and values written in place into storage reserved ahead.

transformers' DynamicLayer appends a step's keys by torch.cat: every decode step copies the whole
cache, per layer [B, K, L, d] for keys and again for values, O(L) bytes per step for one token's
worth of new data (what that cost: docs/benchmarks.md, "The decode's KV cache reserved ahead").
A ReservedLayer holds a store [B, K, C, d] with C >= L columns:

    update(k [B, K, n, d]):   store[:, :, L : L + n] = k;   L += n;   keys = store[:, :, :L]

and when L + n > C it moves to a store of grown(L + n) columns, a quarter more (at least GROW):
one copy, and the copies of a decode of T tokens add up to O(L + T) bytes, not O(L T).
`reserve(cache, need)` moves a prefilled DynamicCache's layers into stores with room for the tokens
its rows may still decode (`need`), capped at what a full store grows by, so a short decode
reserves little and a long one grows. `update` returns the whole store, the columns past the
tokens zero and masked (get_mask_sizes reports them, as transformers' StaticLayer does): attention
over them adds exact zeros, so a decode's tokens and logprobs are those over DynamicLayer's
concatenation up to the blocking of the attention's sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tracetrain.engines.layers import is_kv

GROW = 64  # a full store grows by max(GROW, a quarter of its tokens)


def grown(need: int) -> int:
    """The columns of a store grown to hold `need` tokens."""
    return need + max(GROW, need // 4)


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer over reserved storage (module docstring): `keys` and `values`
    are views [B, K, L, d] of the tokens written; `update` returns the whole stores [B, K, C, d]
    (columns L.. zero) and `get_mask_sizes` their C columns, as transformers' StaticLayer does."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        B, K, L, d = keys.shape
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._k = keys.new_zeros((B, K, L + room, d))
        self._v = values.new_zeros((B, values.shape[1], L + room, values.shape[3]))
        self._k[:, :, :L] = keys
        self._v[:, :, :L] = values
        self._set(L)

    def _set(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def _capacity(self, n: int) -> int:
        """The columns the stores have once n more tokens are written."""
        C = self._k.shape[-2]
        return C if self.length + n <= C else grown(self.length + n)

    @property
    def stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value stores [B, K, C, d] (columns from `length` on: zero, free)."""
        return self._k, self._v

    def make_room(self, n: int) -> None:
        """Stores with room for n more tokens (grown when full)."""
        L, C = self.length, self._capacity(n)
        if C > self._k.shape[-2]:
            self._k = F.pad(self._k[:, :, :L], (0, 0, 0, C - L))
            self._v = F.pad(self._v[:, :, :L], (0, 0, 0, C - L))

    def advance(self, n: int) -> None:
        """Count the n tokens a caller wrote into the stores' next columns (after make_room)."""
        self._set(self.length + n)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        L, n = self.length, key_states.shape[-2]
        self.make_room(n)
        self._k[:, :, L : L + n] = key_states
        self._v[:, :, L : L + n] = value_states
        self.advance(n)
        return self._k, self._v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._capacity(query_length), 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        keep = max(0, min(self.length, max_length))
        self._k[:, :, keep:] = 0
        self._v[:, :, keep:] = 0
        self._set(keep)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._set(self.length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._set(self.length)


def reserve(cache: DynamicCache, need: int) -> DynamicCache:
    """`cache` (attention layers, each [B, K, L, d]; conv layers, engines/layers.py, stay as they
    are) with each attention layer moved into a ReservedLayer of L + min(need, grown(L) - L)
    columns: `need` the most tokens a row may still write (a longer decode grows its stores). The
    same keys and values; `cache` is changed in place and returned."""
    L = cache.get_seq_length()
    room = max(0, min(need, grown(L) - L))
    cache.layers = [ReservedLayer(layer.keys, layer.values, room) if is_kv(layer) else layer
                    for layer in cache.layers]
    return cache
