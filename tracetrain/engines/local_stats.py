"""The local engine's counters: one object, read as a mapping by the run (`engine.stats["tokens"]`,
`dict(engine.stats)`: run/step.py's ENGINE_WORK), counted by the decoder (engines/decoder.py), the
prefill (engines/prefill.py) and the decode step (engines/decode_graph.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(eq=False)
class LocalStats(MutableMapping):
    """Counts since the engine started, cumulative; seconds are perf_counter seconds."""

    batches: int = 0
    """Decode loops: one per batch handed to the decoder."""
    requests: int = 0
    """Requests decoded, those that joined a decoding batch included."""
    forward_calls: int = 0
    """Forward passes of the model: each prefill's (one per level of shared prefixes, one for
    the prompts' rest) and each decode step's."""
    tokens: int = 0
    """Decode row-steps: every row of the batch at each step, a finished row counted until the
    batch is compacted."""
    max_batch: int = 0
    """The most live rows one batch held."""
    joined: int = 0
    """Requests that joined a batch while it decoded (engines/join.py)."""
    prompt_tokens: int = 0
    """Tokens of the prompts prefilled (engines/prefill.py counts these three)."""
    prefill_tokens: int = 0
    """Tokens the prefills forwarded: padding included, a shared prefix once."""
    prefix_cache_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache, per row: a step's hit rate is
    prefix_cache_tokens / prompt_tokens."""
    prefill_s: float = 0.0
    """Seconds of prefill, joiners' included."""
    decode_forward_s: float = 0.0
    """Seconds of the decode steps' forward passes."""
    sample_s: float = 0.0
    """Seconds of sampling and its bookkeeping (stop checks, streaming)."""
    scored_tokens: int = 0
    """Response tokens scored (engines/score.py: a teacher's logprobs, no sampling)."""
    score_s: float = 0.0
    """Seconds of scoring."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keys a measurement adds (a bench's own timer), read and written like the others."""

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key) if key in COUNTERS else self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in COUNTERS:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        del self.extra[key]  # (the counters themselves stay)

    def __iter__(self) -> Iterator[str]:
        yield from COUNTERS
        yield from self.extra

    def __len__(self) -> int:
        return len(COUNTERS) + len(self.extra)

    def batch_started(self, rows: int) -> None:
        self.batches += 1
        self.requests += rows
        self.max_batch = max(self.max_batch, rows)

    def rows_joined(self, rows: int, live: int) -> None:
        self.requests += rows
        self.joined += rows
        self.max_batch = max(self.max_batch, live)

    @contextmanager
    def timing(self, key: str) -> Iterator[None]:
        """Adds the seconds of the `with` body to counter `key`."""
        t = time.perf_counter()
        yield
        self[key] += time.perf_counter() - t


COUNTERS = tuple(f.name for f in fields(LocalStats) if f.name != "extra")
