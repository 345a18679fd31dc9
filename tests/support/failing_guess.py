"""The guess demo (examples/guess/task.py) with agents whose rollouts fail for real reasons
(tests/run/test_fail_fast.py):

    agent             the demo's agent: every rollout plays
    tool_down_agent   rollout n1 of every group first calls a tool server that is not there (a
                      refused connection: the agent raises); the others play
    late_tool_down_agent  every rollout from step 1 on calls that tool server; step 0 plays
    first_step_agent  in step 0 every model call asks for more tokens than the engine's context
                      holds, and the engine refuses it (HTTP 400, the agent raises); later steps
                      play
"""

from __future__ import annotations

import socket

import httpx
from guess_demo import guess

tasks = guess.tasks
warm_start_transcripts = guess.warm_start_transcripts
TOO_MANY_TOKENS = 100_000  # more than the tiny model's context (its max_position_embeddings)


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def agent(task: dict, client: dict) -> float:
    return await guess.play(task, client, guess.chat_prompt)


def _step(client: dict) -> str:
    """The rollout's step as its id names it (`<nonce>-s<step>-t<task>-n<k>`): "s0", "s1", ..."""
    return client["rollout_id"].split("-")[1]


async def _look_up(task: dict) -> None:
    """The task looked up on a tool server: there is none (httpx.ConnectError)."""
    async with httpx.AsyncClient(timeout=5) as http:
        (await http.get(f"http://127.0.0.1:{_closed_port()}/lookup")).raise_for_status()


async def tool_down_agent(task: dict, client: dict) -> float:
    if client["rollout_id"].endswith("-n1"):
        await _look_up(task)
    return await guess.play(task, client, guess.chat_prompt)


async def late_tool_down_agent(task: dict, client: dict) -> float:
    if _step(client) != "s0":
        await _look_up(task)
    return await guess.play(task, client, guess.chat_prompt)


async def first_step_agent(task: dict, client: dict) -> float:
    """Step 0's rollouts (ids `<nonce>-s0-...`) ask for TOO_MANY_TOKENS per call."""
    if _step(client) == "s0":
        client = {**client, "max_tokens": TOO_MANY_TOKENS}
    return await guess.play(task, client, guess.chat_prompt)
