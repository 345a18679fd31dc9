"""A scripted expert for guess_env.py, right about half the time: it guesses the lowest number the
feedback leaves, except that in 70% of the games (chosen by a hash of the game's opening, so a run
repeats) it gets stuck once 2 is the lowest number left: it guesses 1, which is already ruled out,
again and again. So it always finds 1, and 2 to 4 in 30% of the games: 48% in all. Guessing the
lowest number left always wins within the 4 guesses: RL has room above the expert.
The warm start teaches the policy the tool and the feedback, the expert's mistakes included.

Used by config.yaml's `warm_start.expert: {kind: scripted, path: expert.py:expert}`.
"""

from __future__ import annotations

import hashlib
import json
import re

LEFT = re.compile(r"the number is from (\d+) to (\d+)")
STUCK_AT = 2  # the lowest number left at which the expert may get stuck
STUCK_PERCENT = 70  # the share of games in which it does


def stuck(opening: str) -> bool:
    """Whether the expert gets stuck in the game that opened with this text."""
    return hashlib.sha256(opening.encode()).digest()[0] * 100 // 256 < STUCK_PERCENT


def expert(messages: list[dict], tools: list[dict] | None) -> dict:
    """The next assistant message: a call of the `step` tool with the next guess."""
    low, opening = 1, next(str(m.get("content")) for m in messages if m["role"] == "user")
    for m in messages:
        left = LEFT.search(str(m.get("content") or "")) if m["role"] == "tool" else None
        if left:
            low = int(left.group(1))
    guess = low - 1 if low == STUCK_AT and stuck(opening) else low
    return {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "step", "arguments": json.dumps({"guess": guess})}}]}
