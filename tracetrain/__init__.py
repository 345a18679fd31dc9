"""tracetrain: reinforcement learning for LLM agents from the traces of their real runs."""

import os

# oneDNN (torch's bf16 matmuls on CPU) keeps each primitive it builds, one per matmul shape, in two
# caches of 1,024 entries by default, ~1 MB a shape the two together: packed rows change length
# every step, so a run's resident set grows every step until they fill (~1 GB). 128 entries hold
# the shapes in use; a shape built again costs ~0.4 ms (docs/benchmarks.md, "oneDNN's caches"). A
# user's own setting wins. The caches read these when first used: they are set before anything
# runs a matmul.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")

from tracetrain.types import Rollout, RolloutState, TraceError, Turn

__all__ = ["Rollout", "RolloutState", "TraceError", "TrainingBatch", "Turn"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`TrainingBatch` is imported on first use: it loads torch, which a process that only runs
    agents (a Ray worker, a command importing tracetrain.agents.runner) does not need (~2 s, ~300 MB)."""
    if name == "TrainingBatch":
        from tracetrain.rows.batch import TrainingBatch

        return TrainingBatch
    raise AttributeError(f"module 'tracetrain' has no attribute {name!r}")
