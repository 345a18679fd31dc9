"""A run's task module and its agent, resolved from the config (`task`, `agent`): used by the
trainer, the verl backend and the agent worker processes alike."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from tracetrain.config import ConfigError
from tracetrain.runner import load_agent


def load_task(spec: str, base_dir: Path | None = None):
    """A task module: a path to a .py file (relative to the config file, then the cwd) or a module
    name. It defines `tasks(n, seed=..., **task_args)` and `agent(task, client)`, and optionally
    `warm_start_transcripts(n, seed=..., **task_args)`."""
    if spec.endswith(".py"):
        candidates = [Path(spec)] if Path(spec).is_absolute() else [
            *([base_dir / spec] if base_dir else []), Path.cwd() / spec]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(f"config key 'task': no file {spec!r} (looked in {[str(c) for c in candidates]})")
        mod_spec = importlib.util.spec_from_file_location(f"tracetrain_task_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise ConfigError(f"config key 'task': cannot import {spec!r}: {e}") from None
    if not callable(getattr(module, "tasks", None)):
        raise ConfigError(f"config key 'task': {spec!r} defines no function 'tasks'")
    return module


def resolve_agent(task_module: Any, name: str):
    """The task module's function `name`, else a `module:function` or a command (runner.load_agent)."""
    fn = getattr(task_module, name, None)
    if callable(fn):
        return fn
    if ":" in name or " " in name:
        return load_agent(name)
    raise ConfigError(f"config key 'agent': the task module has no function {name!r}")
