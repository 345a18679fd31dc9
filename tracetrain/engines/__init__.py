"""Engines generate a response for exact prompt token ids and return its ids and logprobs.

    LocalEngine(model, tokenizer)                                      # engines/local.py, in-process
    UpstreamEngine(base_url=url, model="m", tokenizer=tok, max_context=4096)  # engines/upstream.py
    start_engine(cfg, weights, tokenizer, ...)    # engines/start.py: the kind a run's config names

This package holds the contract (engines/base.py); implementations are imported where used, so
importing it stays light.
"""

from __future__ import annotations

from tracetrain.engines.base import (
    Engine,
    EngineError,
    Generation,
    PromptTooLong,
    SamplingParams,
    check_sampling_params,
)

__all__ = [
    "Engine",
    "EngineError",
    "Generation",
    "PromptTooLong",
    "SamplingParams",
    "check_sampling_params",
]
