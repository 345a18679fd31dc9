"""A scripted expert for env.py's ArithmeticEnv, right about half the time: it calls `calculate`
on the question's expression, then submits the result, but for about half of the questions
(chosen by a hash of the question: the same ones every run) it submits the result off by one.
A demonstrator that is often wrong, as a script or a weaker model is: the warm start teaches the
policy the tools and the format, and RL has room above it.

Used by config.yaml's `warm_start.expert: {kind: scripted, path: expert.py:expert}`; it sees the
chat messages and tools the policy would, and answers as a chat assistant message.
"""

from __future__ import annotations

import hashlib
import json
import re

QUESTION = re.compile(r"What is (\d+ [-+*] \d+)\?")


def _off_by_one(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] % 2 == 1


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def expert(messages: list[dict], tools: list[dict] | None) -> dict:
    """The next assistant message: calculate the question's expression, then submit its value."""
    asked = QUESTION.search(next(m["content"] for m in messages if m["role"] == "user"))
    question, expression = asked.group(0), asked.group(1)  # "What is 3 * 10?", "3 * 10"
    if messages[-1]["role"] != "tool":
        return _call("calculate", expression=expression)
    value = int(messages[-1]["content"])
    return _call("submit", answer=value + 1 if _off_by_one(question) else value)
