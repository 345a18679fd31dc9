"""A scripted expert for guess_env.py, right half the time: it guesses the lowest number the
feedback leaves, except that once the feedback says "from 4 to ..." it guesses 3, which is
already ruled out, again and again. So it finds the secrets 1, 2 and 3 and never 4, 5 or 6.
Guessing the lowest number left always wins within the 6 guesses; the warm start teaches the
policy the tool and the feedback, mistakes included, and RL has room above it.

Used by config.yaml's `warm_start.expert: {kind: scripted, path: expert.py:expert}`.
"""

from __future__ import annotations

import json
import re

LEFT = re.compile(r"the number is from (\d+) to (\d+)")
STUCK_AT = 4  # the lowest number left at which the expert goes wrong


def expert(messages: list[dict], tools: list[dict] | None) -> dict:
    """The next assistant message: a call of the `step` tool with the next guess."""
    low = 1
    for m in messages:
        left = LEFT.search(str(m.get("content") or "")) if m["role"] == "tool" else None
        if left:
            low = int(left.group(1))
    guess = low - 1 if low == STUCK_AT else low
    return {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "step", "arguments": json.dumps({"guess": guess})}}]}
