"""What every environment adapter is: a task source (its rows) and an agent that plays one task
through the gateway, registered under the `env.kind` that chooses it:

    @register_env("kind")                       # registry.ENV_KINDS, in the adapter's module
    class MyEnv(Environment): ...
    open_environment(cfg.env)                   # -> ENV_KINDS[cfg.env.kind](cfg.env)

An Environment is built from its config section alone (`env`, already validated, paths
absolute) and pickles as that section: a worker process (`rollout.agent_workers`) or a Ray worker
rebuilds it and opens what it holds (a dataset, a server, a worker in another venv) on first use
there. Its agent makes one environment instance per rollout, closes it when the rollout ends, and
raises on anything it cannot score; the runner makes that a failed rollout with the traceback
(runner.call_agent), and a timeout a timed_out one: never a failed step.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracetrain import registry
from tracetrain.agents.dataset import TaskRows
from tracetrain.types import UsageError

ENV_KINDS = registry.ENV_KINDS
register_env = ENV_KINDS.register
PACKAGES = {"reasoning_gym": "reasoning-gym", "verifiers": "verifiers", "openenv": "openenv-core",
            "trl": "trl"}


class EnvError(UsageError):
    """An environment that cannot be used as configured; the message names the config key."""


class Environment:
    """A task source and its agent. Subclasses register under their kind (`register_env`) and
    implement `agent`; `rows` returns the tasks it brings (None: data.train's rows are the
    tasks)."""

    def __init__(self, config: Any):
        self.config = config

    def __reduce__(self):
        return (type(self), (self.config,))

    def rows(self) -> TaskRows | None:
        """The rows the run trains on (and holds out from, with data.eval_fraction)."""
        return None

    def eval_rows(self) -> TaskRows | None:
        """Held-out rows of the environment's own (verifiers' eval_dataset); None: none."""
        return None

    async def agent(self, task: dict, client: dict) -> float | dict | None:
        """Play `task` through the gateway (`client`: runner.agent_client) -> the rollout's reward,
        or {"reward": r, "turn_rewards": {turn index: reward}}."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment opened in this process (servers, worker processes)."""


class TaskRowsOf(TaskRows):
    """`n` rows, row i being `row(i)` (a dict), named `name` in errors: an environment's tasks
    (a generated dataset, a loaded one, a list, seeds) as the run's dataset code reads them."""

    def __init__(self, n: int, row: Callable[[int], dict], name: str):
        self.n, self.row, self.name = n, row, name

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        i = int(i)  # (a numpy index seeds no random.Random)
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.row(i)


def need(module: str, key: str):
    """Import `module`, or an EnvError naming the config key and the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise EnvError(f"config key '{key}': needs the package {PACKAGES.get(top, top)!r} "
                               f"(pip install {PACKAGES.get(top, top)}): {e}") from None


def load_object(spec: str, key: str) -> Any:
    """The object named by `module:name` or `/abs/file.py:name` (config.ObjectSpec made the path
    absolute); EnvError naming the config key when it is not there."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        module_name = f"tracetrain_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
        module = sys.modules.get(module_name)
        if module is None:
            if not path.is_file():
                raise EnvError(f"config key '{key}': no file {target!r}")
            found = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module
            try:
                found.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise EnvError(f"config key '{key}': cannot import {target!r}: {e}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise EnvError(f"config key '{key}': {target!r} has no {name!r}") from None


def open_environment(env_config: Any) -> Environment:
    """The Environment of a config's `env` section (config.EnvConfig): its kind's adapter."""
    return ENV_KINDS[ENV_KINDS.resolve(env_config.kind)](env_config)


def openai_for(client: dict):
    """An `openai.AsyncOpenAI` on the rollout's gateway URL (the runner's shared HTTP client)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                       http_client=client.get("http_client"))


def sampling(client: dict, turn: int = 0) -> dict:
    """The run's sampling settings for the `turn`-th model call of a rollout, as chat.completions
    arguments (a given seed made distinct per call)."""
    seed = client.get("seed")
    return {"model": client["model"], "temperature": client.get("temperature", 1.0),
            "top_p": client.get("top_p", 1.0), "max_tokens": client.get("max_tokens"),
            **({} if seed is None else {"seed": seed + turn})}
