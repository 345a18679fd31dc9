"""A `verifiers.v1` taskset (verifiers 0.4): tasks from `load`, two rewards on the task. Its id is
this module's name (`vf-eval vf_v1_digits`); the agent plays it with a harness chosen in the env
config (`agent: {harness: {id: null}}`: verifiers' plain chat loop)."""

import verifiers.v1 as vf

WEIGHTS = (1.0, 0.5)


def expected_reward(text: str) -> float:
    """The task's reward of a reply, computed here without verifiers (for the tests)."""
    return WEIGHTS[0] * float(any(ch.isdigit() for ch in text)) + WEIGHTS[1] * (1.0 - min(len(text), 40) / 40)


class DigitsData(vf.TaskData):
    answer: str = ""


class DigitsTask(vf.Task[DigitsData]):
    @vf.reward(weight=WEIGHTS[0])
    async def has_digit(self, trace: vf.Trace) -> float:
        return float(any(ch.isdigit() for ch in trace.last_reply))

    @vf.reward(weight=WEIGHTS[1])
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 - min(len(trace.last_reply), 40) / 40

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class DigitsConfig(vf.TasksetConfig):
    num_tasks: int = 12


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsConfig]):
    def load(self):
        return [DigitsTask(DigitsData(prompt=f"What is {i} plus {i + 1}?", answer=str(2 * i + 1),
                                      system_prompt="Answer with a number."), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["DigitsTaskset"]
