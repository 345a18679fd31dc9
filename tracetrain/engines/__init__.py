"""Engines generate a response for exact prompt token ids and return its ids and logprobs.

    make_engine("local", model=model, tokenizer=tok)                       # transformers, in-process
    make_engine("upstream", base_url=url, model="m", tokenizer=tok, max_context=4096)  # vLLM server

Implementations are imported on first use, so importing this package stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from tracetrain.engines.base import (
    Engine,
    EngineError,
    Generation,
    PromptTooLong,
    SamplingParams,
    check_sampling_params,
)

ENGINES: dict[str, str] = {
    "local": "tracetrain.engines.local:LocalEngine",
    "upstream": "tracetrain.engines.upstream:UpstreamEngine",
}


def make_engine(kind: str, **config: Any) -> Engine:
    """Build the engine registered under `kind` with `config` as its keyword arguments."""
    if kind not in ENGINES:
        raise ValueError(
            f"engine kind {kind!r} is unknown; known kinds: {', '.join(sorted(ENGINES))}"
        )
    module, cls = ENGINES[kind].split(":")
    return getattr(importlib.import_module(module), cls)(**config)


__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "Generation",
    "PromptTooLong",
    "SamplingParams",
    "check_sampling_params",
    "make_engine",
]
