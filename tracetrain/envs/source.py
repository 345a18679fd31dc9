"""A run's task source, chosen here, where both kinds are visible: its environment (`env`, an
Environment whose `agent` plays a task) or its task module (`task`, agents/tasks.py's load_task).
Used by the trainer, the verl backend and `tracetrain eval` alike."""

from __future__ import annotations

from pathlib import Path

from tracetrain.agents.tasks import load_task
from tracetrain.envs.base import Environment, open_environment


def load_source(cfg, base_dir: Path | None = None) -> Environment | object:
    """The environment `env` names, or the task module `task` names (its `tasks` function
    optional when the tasks come from `data.train`)."""
    if cfg.env is not None:
        return open_environment(cfg.env)
    return load_task(cfg.task, base_dir, needs_tasks=cfg.data.train is None)
