"""The guess demo (examples/guess/task.py) with its agent's model calls each held back by a random,
unseeded 0-30 ms: the calls reach the engine, and the rollouts finish, in an order that changes
from run to run (tests/run/test_reproducible.py)."""

from __future__ import annotations

import asyncio
import random

import httpx
from guess_demo import guess

tasks = guess.tasks
warm_start_transcripts = guess.warm_start_transcripts
_rng = random.SystemRandom()  # not the run's seed: a different order every run


async def _jitter(request: httpx.Request) -> None:
    await asyncio.sleep(_rng.uniform(0.0, 0.03))


async def agent(task: dict, client: dict) -> float:
    """The demo's agent, each of its HTTP requests sent after a random delay."""
    async with httpx.AsyncClient(event_hooks={"request": [_jitter]}, timeout=60) as http:
        return await guess.play(task, {**client, "http_client": http}, guess.chat_prompt)
