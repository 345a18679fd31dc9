"""A classic multi-turn environment: the model is asked three times; each turn's step gets its own
reward (a digit in the reply), the rubric's reward is their mean."""

import verifiers as vf
from datasets import Dataset


def text_of(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content or ""


def step_reward(text: str) -> float:
    return float(any(ch.isdigit() for ch in text))


class AgainEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"Again, turn {len(state['trajectory']) + 1}."}]

    async def add_trajectory_step(self, state, trajectory_step):
        trajectory_step["reward"] = step_reward(text_of(trajectory_step["completion"][-1]))
        await super().add_trajectory_step(state, trajectory_step)


def mean_step(state, **kwargs) -> float:
    steps = state["trajectory"]
    return sum(s["reward"] for s in steps) / len(steps)


def load_environment(turns: int = 3) -> vf.Environment:
    rows = [{"question": f"Say a number near {i}.", "answer": str(i)} for i in range(8)]
    return AgainEnv(dataset=Dataset.from_list(rows), max_turns=turns,
                    rubric=vf.Rubric(funcs=[mean_step]))
