"""A task for the continuous-collection tests: a few turns of chat whose reward differs between
the rollouts of a group (the length of each answer mod 3), so updates move the policy; task j
with `slow_every` and (j % slow_every == 0) waits `slow_s` after each call (an environment step
that takes time: such rollouts span weight updates)."""

from __future__ import annotations

import asyncio
from typing import Any

from openai import AsyncOpenAI


def tasks(n: int, *, seed: int, slow_every: int = 0, slow_s: float = 0.0, **_: Any) -> list[dict]:
    return [{"id": seed * 100 + j, "turns": 2 + (seed + j) % 2,
             "delay_s": slow_s if slow_every and j % slow_every == 0 else 0.0} for j in range(n)]


async def agent(task: dict, client: dict) -> float:
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    messages = [{"role": "system", "content": f"Task {task['id']}."}, {"role": "user", "content": "Go."}]
    score = 0.0
    for turn in range(task["turns"]):
        out = await openai.chat.completions.create(
            model=client["model"], messages=messages, temperature=client.get("temperature", 1.0),
            max_tokens=client.get("max_tokens", 6),
            seed=None if client.get("seed") is None else client["seed"] + turn)
        text = out.choices[0].message.content or ""
        score += (len(text) % 3) / 2
        if task["delay_s"]:
            await asyncio.sleep(task["delay_s"])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    return score / task["turns"]
