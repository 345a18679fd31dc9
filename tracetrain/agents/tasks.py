"""A run's task module, its dataset and its agent, resolved from the config (`task`, `data`,
`agent`); used by the trainer, the verl backend, `tracetrain eval` and the agent worker processes
alike. An environment (`env`) is opened by tracetrain/envs, whose `load_source` chooses between
the two; `open_task_data` takes the rows of either."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from tracetrain.agents.runner import load_agent
from tracetrain.config import ConfigError
from tracetrain.paths import near_config, not_found


def load_task(spec: str, base_dir: Path | None = None, *, needs_tasks: bool = True):
    """A task module: a path to a .py file (relative to the config file, then the cwd) or a module
    name. It defines `tasks(n, seed=..., **task_args)` and `agent(task, client)`, and optionally
    `warm_start_transcripts(n, seed=..., **task_args)`. `needs_tasks` false (a run whose tasks
    come from `data.train`): `tasks` may be missing. A file's folder goes on `sys.path` first, as
    `python task.py` puts it: the module imports the modules beside it."""
    if spec.endswith(".py"):
        path = near_config(spec, base_dir, Path.is_file)
        if path is None:
            raise ConfigError(f"config key 'task': {not_found(spec, base_dir)}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        mod_spec = importlib.util.spec_from_file_location(f"tracetrain_task_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise ConfigError(f"config key 'task': cannot import {spec!r}: {e}") from None
    if needs_tasks and not callable(getattr(module, "tasks", None)):
        raise ConfigError(f"config key 'task': {spec!r} defines no function 'tasks' (or give "
                          "data.train: tasks from a dataset file)")
    return module


def open_task_data(cfg, base_dir: Path | None = None, source=None):
    """The run's dataset (dataset.TaskData): `data.train`'s rows, or those of the environment
    `source` (envs.load_source) that brings its own; None when the tasks come from the task module's
    `tasks`. Paths are relative to the config file, then the working directory. Every row is checked
    for `data.fields` here, before any training."""
    from tracetrain.agents.dataset import DatasetError, TaskData, open_rows

    dc = cfg.data
    own = source.rows() if cfg.env is not None and source is not None else None
    if own is not None:
        try:
            return TaskData(own, eval_rows=source.eval_rows(), eval_fraction=dc.eval_fraction,
                            split_seed=dc.split_seed, seed=cfg.trainer.seed, shuffle=dc.shuffle,
                            fields=dc.fields)
        except DatasetError as e:
            raise ConfigError(f"config key 'env' (kind {cfg.env.kind}): {e}") from None
    if dc.train is None:
        return None

    def path(key: str, value: str) -> Path:
        found = near_config(value, base_dir)
        if found is None:
            raise ConfigError(f"config key 'data.{key}': {not_found(value, base_dir)}")
        return found

    try:
        return TaskData(open_rows(path("train", dc.train)),
                        eval_rows=None if dc.eval is None else open_rows(path("eval", dc.eval)),
                        eval_fraction=dc.eval_fraction, split_seed=dc.split_seed,
                        seed=cfg.trainer.seed, shuffle=dc.shuffle, fields=dc.fields)
    except DatasetError as e:
        raise ConfigError(f"config key 'data': {e}") from None


def resolve_agent(task_module: Any, name: str):
    """The task module's function `name`, else a `module:function` or a command (runner.load_agent)."""
    fn = getattr(task_module, name, None)
    if callable(fn):
        return fn
    if ":" in name or " " in name:
        return load_agent(name)
    raise ConfigError(f"config key 'agent': the task module has no function {name!r}")
