"""A decoding batch: its requests, and each batch row's tensors, as the decoder's loop moves them.

Batch row b decodes request rows[b]. Its state, one entry per row: the next-token logits, the KV
cache and its mask (each row's tokens right-aligned, the padding on the left masked), the position
of the next token, the temperature and top_p of its request, and the ids sampled last (the next
step's input). `reserve` gives the cache room for the tokens the rows may still decode
(engines/kv_cache.py). A finished row stays in the batch, not live, until `compact` drops the
finished rows from every tensor and the cache together; `join` puts the rows of another batch
(requests prefilled while this one decoded) after this one's (engines/join.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tracetrain.engines.join import join_rows
from tracetrain.engines.kv_cache import reserve


@dataclass
class Batch:
    """The state of a decoding batch (module docstring)."""

    requests: list[Any]
    """Every request of the batch (engines/decoder.py's Request), joiners appended in place."""
    rows: list[int]
    """rows[b]: the index in `requests` of the request batch row b decodes."""
    live: list[bool]
    """live[b]: row b still decodes (False once finished, until `compact`)."""
    logits: torch.Tensor
    """[R, V] float32: each row's next-token logits."""
    cache: Any
    """The KV cache, per layer keys and values [R, K, L, d] (engines/kv_cache.py)."""
    mask: torch.Tensor
    """[R, L] of 0/1: the cache's real tokens."""
    next_pos: torch.Tensor
    """[R]: the position of each row's next token."""
    temperature: torch.Tensor
    """[R]: each row's temperature (0: greedy)."""
    top_p: torch.Tensor
    """[R]: each row's top_p."""
    stops: list[frozenset[int]]
    """Per request: the token ids that end it."""
    adapter_of: list[str] | None
    """Per request: the LoRA adapter that decodes it (None: the model has no adapters)."""
    tokens: torch.Tensor | None = None
    """[R]: the ids sampled last, the next step's input (None before the first sample)."""
    logprobs: torch.Tensor | None = None
    """[R]: the sampled ids' logprobs (engines/sampling.py)."""

    @property
    def adapters(self) -> list[str] | None:
        """Each row's adapter (None without adapters)."""
        return None if self.adapter_of is None else [self.adapter_of[i] for i in self.rows]

    def n_live(self) -> int:
        return sum(self.live)

    def room(self) -> int:
        """The most tokens a row may still decode."""
        reqs = self.requests
        return max(reqs[i].params.max_tokens - len(reqs[i].ids) for i in self.rows)

    def reserve(self) -> None:
        """The cache moved into stores with room for the tokens its rows may still decode."""
        self.cache = reserve(self.cache, self.room())

    def join(self, new: Batch) -> None:
        """`new`'s rows (not sampled yet) after this batch's; its requests appended to ours."""
        n = len(self.requests)
        self.rows += [n + i for i in new.rows]
        self.requests += new.requests
        if self.adapter_of is not None:
            self.adapter_of += new.adapter_of
        self.cache, self.mask = join_rows(self.cache, self.mask, new.cache, new.mask)
        self.logits = torch.cat([self.logits, new.logits])
        self.next_pos = torch.cat([self.next_pos, new.next_pos])
        self.temperature = torch.cat([self.temperature, new.temperature])
        self.top_p = torch.cat([self.top_p, new.top_p])
        self.stops += new.stops
        self.live += new.live

    def compact(self) -> None:
        """Drop the finished rows once they are a quarter of the batch or more."""
        R, live = len(self.rows), self.live
        if 4 * (R - sum(live)) < R:
            return
        keep = torch.tensor([b for b in range(R) if live[b]], device=self.mask.device)
        self.cache.batch_select_indices(keep)
        self.mask, self.next_pos = self.mask[keep], self.next_pos[keep]
        self.tokens, self.temperature, self.top_p = (
            self.tokens[keep], self.temperature[keep], self.top_p[keep])
        self.rows = [self.rows[b] for b in range(R) if live[b]]
        self.live = [True] * len(self.rows)
