"""A classic (verifiers 0.3) single-turn environment: questions from a local dataset, a rubric of
two reward functions. Loaded as verifiers does: `verifiers.load_environment("vf-digits")` imports
this module (on the path) and calls `load_environment`."""

import verifiers as vf
from datasets import Dataset


def reply_text(completion) -> str:
    """The text of the last assistant message (chat completion: a list of messages)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1]
    content = last["content"] if isinstance(last, dict) else last.content
    return content or ""


def has_digit(completion, **kwargs) -> float:
    return float(any(ch.isdigit() for ch in reply_text(completion)))


def brevity(completion, **kwargs) -> float:
    return 1.0 - min(len(reply_text(completion)), 40) / 40


WEIGHTS = (1.0, 0.5)


def expected_reward(text: str) -> float:
    """The rubric's reward of a reply, computed here without verifiers (for the tests)."""
    return WEIGHTS[0] * float(any(ch.isdigit() for ch in text)) + WEIGHTS[1] * (1.0 - min(len(text), 40) / 40)


def load_environment(num_rows: int = 12, num_eval: int = 4, fail_on: str | None = None) -> vf.Environment:
    rows = [{"question": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(num_rows)]
    held = [{"question": f"What is {i} times 2?", "answer": str(2 * i)} for i in range(num_eval)]
    rubric = vf.Rubric(funcs=[has_digit, brevity], weights=list(WEIGHTS))
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows),
                            eval_dataset=Dataset.from_list(held) if num_eval else None,
                            system_prompt="Answer with a number.", rubric=rubric)
