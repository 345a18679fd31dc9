"""JSON out of the gateway: orjson's speed, and every value JSON allows.

orjson refuses integers beyond 64 bits; JSON allows them, and a client (a tool's schema) or a model
(a tool call's arguments) may send one. `dumps` then writes the same text with the standard
library, so such a request is answered, not failed with a 500, and nothing is rounded.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON of `value` (keys sorted with `sort_keys`)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys,
                          allow_nan=False).encode()
