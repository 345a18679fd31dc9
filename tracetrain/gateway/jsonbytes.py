"""JSON out of the gateway: orjson's speed and orjson's text, for every value a body may hold.

`dumps(value)` is orjson's compact UTF-8 JSON: NaN and ±Infinity are written `null` (JSON has no
such numbers; a body the gateway parsed may hold them: pydantic's JSON parser reads `NaN`,
`Infinity` and `1e400`), non-ASCII unwritten as escapes. Two things orjson cannot write, and a
body may hold, are written in the same form:

- an integer beyond 64 bits (JSON allows it; a client's tool schema or a model's tool-call
  arguments may hold one): its exact digits, never rounded;
- nesting deeper than orjson writes (254 levels).

Anything else orjson refuses (a non-str dict key, an object no JSON encoder writes, a string with
a lone surrogate) raises TypeError, as orjson does.
"""

from __future__ import annotations

from typing import Any

import orjson


class _Text(bytes):
    """Output already written (punctuation, a key): appended as it is."""


_OPEN_LIST, _CLOSE_LIST, _COMMA = _Text(b"["), _Text(b"]"), _Text(b",")
_OPEN_DICT, _CLOSE_DICT = _Text(b"{"), _Text(b"}")


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON of `value` (keys sorted with `sort_keys`), byte for byte orjson's
    wherever orjson writes it (module docstring)."""
    option = orjson.OPT_SORT_KEYS if sort_keys else None
    try:
        return orjson.dumps(value, option=option)
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, deep nesting, or not JSON
        return _dumps(value, option)


def _dumps(value: Any, option: int | None) -> bytes:
    """What orjson would write for `value` if it had no 64-bit and no depth limit: each subtree
    orjson writes is written by it; a list or dict it refuses is written here, item by item
    (iteratively: no recursion limit either); an int it refuses is written as its digits."""
    out = bytearray()
    todo: list[Any] = [value]  # a stack: what is still to be written, the next on top
    while todo:
        item = todo.pop()
        if type(item) is _Text:
            out += item
            continue
        try:
            out += orjson.dumps(item, option=option)
            continue
        except TypeError as e:
            refused = e
        if isinstance(item, int) and not isinstance(item, bool):  # beyond 64 bits
            out += int.__repr__(item).encode()
        elif isinstance(item, (list, tuple)):
            todo.append(_CLOSE_LIST)
            for k in range(len(item) - 1, -1, -1):
                todo.append(item[k])
                if k:
                    todo.append(_COMMA)
            todo.append(_OPEN_LIST)
        elif isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise TypeError("Dict key must be str")
            keys = sorted(item) if option else list(item)
            todo.append(_CLOSE_DICT)
            for k in range(len(keys) - 1, -1, -1):
                todo.append(item[keys[k]])
                todo.append(_Text(orjson.dumps(keys[k]) + b":"))  # raises for a lone surrogate
                if k:
                    todo.append(_COMMA)
            todo.append(_OPEN_DICT)
        else:  # a string with a lone surrogate, an object no JSON encoder writes: orjson's error
            raise refused
    return bytes(out)
