"""A program of two roles for the several-policies tests: a solver answers twice, a checker reviews
each answer. The reward (the solver's answers' lengths mod 3) and the checker's turn rewards (its
verdict's length, odd or even) differ between the rollouts of a group, so both policies learn."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


def tasks(n: int, *, seed: int, **_: Any) -> list[dict]:
    return [{"id": seed * 100 + j} for j in range(n)]


async def agent(task: dict, client: dict) -> dict:
    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0,
                         http_client=client.get("http_client"))
    seed = client.get("seed")
    kw = {"temperature": client.get("temperature", 1.0), "max_tokens": client.get("max_tokens", 6)}
    messages = [{"role": "system", "content": f"Task {task['id']}."}, {"role": "user", "content": "Go."}]
    score, turn_rewards = 0.0, {}
    for turn in range(2):
        out = await openai.chat.completions.create(
            model="solver", messages=messages, seed=None if seed is None else seed + 2 * turn, **kw)
        text = out.choices[0].message.content or ""
        score += (len(text) % 3) / 2
        check = await openai.chat.completions.create(
            model="checker", messages=[{"role": "system", "content": "Check."},
                                       {"role": "user", "content": text or "?"}],
            seed=None if seed is None else seed + 2 * turn + 1, **kw)
        verdict = check.choices[0].message.content or ""
        turn_rewards[check.model_extra["tracetrain"]["turn_index"]] = 0.5 if len(verdict) % 2 else -0.5
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    return {"reward": score / 2, "turn_rewards": turn_rewards}
