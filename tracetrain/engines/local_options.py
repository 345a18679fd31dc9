"""The local engine's options: one typed object, checked when it is made.

    LocalEngine(model, tokenizer, LocalOptions(threads=2, precision="bf16"))
    LocalEngine(model, tokenizer, threads=2, precision="bf16")      # the same: fields by name

engines/start.py makes one from a run's config (`engine.kind: local`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tracetrain.engines.prefill import DEFAULT_PREFIX_CACHE_BYTES


@dataclass(frozen=True)
class LocalOptions:
    """How a LocalEngine gathers requests into batches and decodes them."""

    name: str = "local"
    """The engine's name, in its errors."""
    max_context: int | None = None
    """Prompt tokens + max_tokens must fit (None: the model's max_position_embeddings)."""
    max_batch_size: int = 128
    """The most requests one batch decodes at once, those that join it included."""
    batch_window_ms: float = 2.0
    """Gathering: a batch closes once this long passes with no new request and the event loop
    free (engines/local.py)."""
    max_wait_ms: float = 50.0
    """Gathering: a batch closes at the latest this long after its first request."""
    device: str | torch.device | None = None
    """Where the model decodes (None: where its parameters are)."""
    model_version: int = 0
    """The version of the weights the engine starts with."""
    seed: int | None = None
    """Seeds the draws of requests that bring no seed of their own (None: not reproducible)."""
    threads: int = 0
    """torch intra-op threads of the decode (0: the count of the thread that makes the engine)."""
    prefix_cache: bool = True
    """Keep prompt prefixes' KV across batches (engines/prefill.py); False: none kept."""
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    """The most bytes of prefix KV kept between batches, least recently used out."""
    lockstep: Any = None
    """agents/lockstep.py's Lockstep: batches close when every live agent waits on a call, in
    an order that does not depend on arrival, and none joins a decoding batch (None: off)."""
    precision: str = "fp32"
    """fp32, bf16 or auto: the dtype of the forward passes (engines/precision.py)."""
    compile: bool = False
    """Compile the one-function decode step where it runs (engines/decode_graph.py)."""

    def __post_init__(self) -> None:
        if type(self.max_batch_size) is not int or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        if not self.batch_window_ms >= 0 or not self.max_wait_ms >= 0:
            raise ValueError(f"batch_window_ms and max_wait_ms must be >= 0, got "
                             f"{self.batch_window_ms!r}, {self.max_wait_ms!r}")
