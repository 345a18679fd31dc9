"""tracetrain: reinforcement learning for LLM agents from the traces of their real runs."""

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
