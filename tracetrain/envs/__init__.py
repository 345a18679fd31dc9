"""Environments people already have, as task sources (docs/environments.md): reasoning-gym
datasets, verifiers environments, OpenEnv environments and TRL-style environment classes, each
played through the gateway like any agent.

    env = open_environment(cfg.env)       # an Environment; nothing heavy is opened yet
    env.rows(), env.eval_rows()           # the tasks (None: they are data.train's rows)
    await env.agent(task, client)         # one rollout: its reward, or {"reward", "turn_rewards"}
"""

from tracetrain.envs.base import EnvError, Environment, load_object, open_environment

__all__ = ["Environment", "EnvError", "load_object", "open_environment"]
