"""Tool calls out of the model's text, Hermes/Qwen style: `<tool_call>{"name", "arguments"}</tool_call>`.

Only when the request offered `tools`. A block that is not valid JSON with a string "name" stays
plain text (never guessed). The recorded turn is unaffected: it holds the raw response ids.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks or None if nothing is left, OpenAI tool_calls list)."""
    calls, keep, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
        keep.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    keep.append(text[last:])
    content = "".join(keep).strip()
    return content or None, calls
