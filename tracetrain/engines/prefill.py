"""The local engine's prefill: a batch of prompts forwarded with their common prefix computed once,
and the KV of the last such prefix kept for the next batch.

Row layout of the KV cache after a prefill of B prompts whose common prefix has L tokens:

    [common prefix, L tokens (computed once, repeated per row)] [pad ... pad | suffix_b]

with positions 0..L-1 then L, L+1, ... over each row's own suffix (left padding: the last column
holds each row's last prompt token; every row keeps at least one suffix token). The KV of the last
prefix prefilled is kept (for the same model version and adapter): a later batch whose prefix
starts with c >= MIN_SHARED_PREFIX of its ids (the step's system prompt, a group's question)
computes only the rest. A lone prompt's prefix is all but its last token. Rows decoded by
different adapters (several policies) share no prefix: their keys and values differ.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

MIN_SHARED_PREFIX = 8  # a shorter common prefix is not worth a separate forward pass

# forward(input_ids [B, S], attention_mask [B, L+S], position_ids [B, S], cache, adapters) ->
# (next-token logits [B, V], cache); adapters: one adapter name per row, or None
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, "list[str] | None"], tuple]


def common_prefix_len(prompts: list[list[int]]) -> int:
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n


class Prefill:
    """Prefill with a kept prefix (module docstring). `stats` (the engine's) counts the prompt
    tokens forwarded ("prefill_tokens": padding included, a shared prefix once) and those taken
    from the kept prefix ("prefix_cache_tokens")."""

    def __init__(self, forward: Forward, *, pad_id: int, device: torch.device, keep: bool,
                 stats: dict):
        self.forward, self.pad_id, self.device, self.keep, self.stats = forward, pad_id, device, keep, stats
        # the last shared prefix prefilled: (its ids, model version, adapter, KV cache of one row)
        self.last: tuple[list[int], int, str | None, Any] | None = None

    def clear(self) -> None:
        """Forget the kept prefix (its KV came from weights that changed)."""
        self.last = None

    def __call__(self, prompts: list[list[int]], version: int, adapters: list[str] | None = None):
        """(next-token logits [B, V], cache, attention mask [B, L+S], position of the next token
        [B]) for `prompts`, row b decoded by adapter `adapters[b]` (None: the model as it is)."""
        dev, B = self.device, len(prompts)
        one = None if adapters is None else adapters[0]
        mixed = adapters is not None and any(a != one for a in adapters)
        L = common_prefix_len(prompts) if B > 1 else (len(prompts[0]) if self.keep else 0)
        L = 0 if mixed else min(L, min(len(p) for p in prompts) - 1)
        cache, reused = None, 0
        if L >= MIN_SHARED_PREFIX:
            head = prompts[0][:L]
            last = self.last
            if self.keep and last is not None and last[1:3] == (version, one):
                reused = common_prefix_len([last[0][:L], head])
                if reused >= MIN_SHARED_PREFIX:
                    cache = copy.deepcopy(last[3])
                    cache.crop(reused)
                else:
                    reused = 0
            if L > reused:
                prefix = torch.tensor([head[reused:]], device=dev)
                _, cache = self.forward(prefix, torch.ones((1, L), dtype=torch.long, device=dev),
                                        torch.arange(reused, L, device=dev)[None], cache,
                                        None if adapters is None else [one])
            if self.keep:
                self.last = (head, version, one, copy.deepcopy(cache))
            cache.batch_repeat_interleave(B)
            self.stats["prefix_cache_tokens"] += reused
        else:
            L = 0
        S = max(len(p) - L for p in prompts)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L + S), dtype=torch.long)
        mask[:, :L] = 1
        for b, p in enumerate(prompts):
            ids[b, S - (len(p) - L) :] = torch.tensor(p[L:])
            mask[b, L + S - (len(p) - L) :] = 1
        position = L + (mask[:, L:].cumsum(-1) - 1).clamp_(min=0)
        ids, mask, position = ids.to(dev), mask.to(dev), position.to(dev)
        logits, cache = self.forward(ids, mask, position, cache, adapters)
        self.stats["prefill_tokens"] += L - reused + B * S
        return logits, cache, mask, position[:, -1] + 1
