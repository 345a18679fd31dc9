"""Environments people already have, as task sources (docs/environments.md): reasoning-gym
datasets, verifiers environments, OpenEnv environments and TRL-style environment classes, each
played through the gateway like any agent.

    env = open_environment(cfg.env)       # an Environment; nothing heavy is opened yet
    source = load_source(cfg, base_dir)   # the run's: its environment, or its task module
    env.rows(), env.eval_rows()           # the tasks (None: they are data.train's rows)
    await env.agent(task, client)         # one rollout: its reward, or {"reward", "turn_rewards"}
"""

import importlib

from tracetrain import registry
from tracetrain.envs.base import EnvError, Environment, load_object, open_environment, register_env
from tracetrain.envs.source import load_source

# The built-in kinds, registered in one order wherever the package is first imported from (each
# module imports its environment's own package only when an environment opens).
for _home in registry.ENV_KINDS.home:
    importlib.import_module(_home)

__all__ = ["Environment", "EnvError", "load_object", "load_source", "open_environment",
           "register_env"]
