"""tracetrain: reinforcement learning for LLM agents from the traces of their real runs."""

from tracetrain.batch import TrainingBatch
from tracetrain.types import Rollout, RolloutState, TraceError, Turn

__all__ = ["Rollout", "RolloutState", "TraceError", "TrainingBatch", "Turn"]
__version__ = "0.1.0"
