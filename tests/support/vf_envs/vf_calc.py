"""A classic tool environment (verifiers' ToolEnv): the model may call `add`; the rubric checks
the final answer against the row's."""

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def correct(completion, answer, **kwargs) -> float:
    last = completion[-1]
    content = last["content"] if isinstance(last, dict) else last.content
    return float((content or "").strip() == answer)


def load_environment() -> vf.Environment:
    rows = [{"question": "What is 2 + 3? Use the tool.", "answer": "5"}]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=4,
                      rubric=vf.Rubric(funcs=[correct]))
