"""A classic verifiers environment (the 0.3 `load_environment` API), as one is written for
verifiers: sums of two numbers from a dataset it builds, a rubric of two reward functions.

    import verifiers as vf
    env = vf.load_environment("vf-sums")     # imports this module (on the path), calls this

tracetrain trains on it unchanged: `env: {kind: verifiers, env_id: vf-sums}` (config.yaml here).
"""

import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM = "Answer with just the number."


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def reply(completion) -> str:
    last = completion[-1]
    return (last["content"] if isinstance(last, dict) else last.content) or ""


def correct(completion, answer, **kwargs) -> float:
    """1 when the reply's last number is the answer."""
    numbers = re.findall(r"-?\d+", reply(completion))
    return float(bool(numbers) and numbers[-1] == answer)


def concise(completion, **kwargs) -> float:
    """1 for a reply of at most 12 characters (a bare number), else 0."""
    return float(len(reply(completion).strip()) <= 12)


def load_environment(num_train: int = 512, num_eval: int = 32, seed: int = 0) -> vf.Environment:
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(problems(num_train, seed)),
        eval_dataset=Dataset.from_list(problems(num_eval, seed + 1)),
        system_prompt=SYSTEM,
        rubric=vf.Rubric(funcs=[correct, concise], weights=[1.0, 0.2]),
    )
