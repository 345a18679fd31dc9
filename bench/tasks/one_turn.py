"""A one-call task for the training-step benchmark: the agent asks once for digits and is scored by
the fraction of digit characters in the reply (0 for an empty reply).

    reward = #{c in reply : c.isdigit()} / len(reply)

`digit_fraction` is the reward of both sides of bench/bench_train_step.py (tracetrain's agent and
TRL's reward function), so both compute it the same way on the same decoded text.
"""

from __future__ import annotations

from typing import Any

PROMPT = "Write a long number."


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def tasks(n: int, *, seed: int, **_: Any) -> list[dict]:
    """`n` copies of the one prompt (the seed changes nothing: every step has the same work)."""
    return [{"prompt": PROMPT} for _ in range(n)]


async def agent(task: dict, client: dict) -> float:
    """One chat call through the gateway with the runner's sampling settings."""
    from openai import AsyncOpenAI  # imported here: TRL's side only needs digit_fraction

    openai = AsyncOpenAI(
        base_url=client["base_url"],
        api_key=client["api_key"],
        max_retries=0,
        http_client=client.get("http_client"),
    )
    out = await openai.chat.completions.create(
        model=client["model"],
        messages=[{"role": "user", "content": task["prompt"]}],
        temperature=client.get("temperature", 1.0),
        max_tokens=client.get("max_tokens", 64),
        seed=client.get("seed"),
    )
    return digit_fraction(out.choices[0].message.content or "")
