"""The calculator's first call as a one-call task, for bench/bench_grpo_smollm2.py: the system
prompt, the worked example and a question of examples/calculator/task.py, one reply, scored

    reward = 1 if the question's answer is among the reply's integers, else 0

Every step has the same work: `tasks(n)` is the first n questions of the calculator's seed-0
list whatever the seed, and `messages` / `score` are what both sides of the bench use (tracetrain's
agent through the gateway, TRL's dataset and reward function), on the same decoded text.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

CALCULATOR = Path(__file__).resolve().parents[2] / "examples" / "calculator" / "task.py"


def _calculator():
    spec = importlib.util.spec_from_file_location("bench_calculator_task", CALCULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


calculator = _calculator()


def messages(question: str) -> list[dict]:
    """The chat of the calculator's first call: system prompt, worked example, the question."""
    return [{"role": "system", "content": calculator.SYSTEM}, *calculator.EXAMPLE,
            {"role": "user", "content": question}]


def score(text: str, answer: int) -> float:
    return 1.0 if answer in calculator.numbers(text) else 0.0


def tasks(n: int, *, seed: int = 0, **_: Any) -> list[dict]:
    """The first `n` calculator questions of seed 0 (the seed changes nothing)."""
    return [{"question": t["question"], "answer": t["answer"]} for t in calculator.tasks(n, seed=0)]


async def agent(task: dict, client: dict) -> float:
    """One chat call through the gateway with the runner's sampling settings."""
    from openai import AsyncOpenAI

    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    out = await openai.chat.completions.create(
        model=client["model"], messages=messages(task["question"]),
        temperature=client.get("temperature", 1.0), max_tokens=client.get("max_tokens", 32),
        seed=client.get("seed"),
    )
    return score(out.choices[0].message.content or "", task["answer"])
