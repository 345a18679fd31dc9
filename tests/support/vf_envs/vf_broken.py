"""A classic environment that breaks where it is told to: at load, in its rollout (its
env_response), or in a reward function."""

import verifiers as vf
from datasets import Dataset


class Broken(vf.MultiTurnEnv):
    def __init__(self, where, **kwargs):
        super().__init__(**kwargs)
        self.where = where

    async def env_response(self, messages, state, **kwargs):
        if self.where == "rollout":
            raise RuntimeError("the environment broke in env_response")
        return [{"role": "user", "content": "More."}]


def bad_reward(completion, **kwargs) -> float:
    raise ValueError("the reward function broke")


def fine(completion, **kwargs) -> float:
    return 1.0


def load_environment(where: str = "rollout") -> vf.Environment:
    if where == "load":
        raise RuntimeError("the environment broke while loading")
    rows = [{"question": f"Question {i}?", "answer": str(i)} for i in range(4)]
    funcs = [fine, bad_reward] if where == "reward" else [fine]
    return Broken(where, dataset=Dataset.from_list(rows), max_turns=2, rubric=vf.Rubric(funcs=funcs))
