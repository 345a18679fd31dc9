"""The same task as a `verifiers.v1` taskset (verifiers 0.4): `vf-eval vf_sums_v1` would play it;
tracetrain trains on it from the venv verifiers 0.4 lives in (v1.yaml here). The task's rewards
score each episode; the agent's harness is chosen in the env config (`null`: verifiers' plain
chat loop)."""

import random
import re

import verifiers.v1 as vf

SYSTEM = "Answer with just the number."


def problems(n: int, seed: int) -> list[dict]:
    """The problems of vf_sums.py, drawn the same way."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.reward(weight=0.2)
    async def concise(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 12)


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 512
    seed: int = 0


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        return [SumTask(SumData(prompt=p["question"], answer=p["answer"], system_prompt=SYSTEM),
                        self.config.task)
                for p in problems(self.config.num_tasks, self.config.seed)]


__all__ = ["SumsTaskset"]
