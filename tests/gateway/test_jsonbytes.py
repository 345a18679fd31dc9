"""jsonbytes.dumps writes every value a body the gateway accepted may hold (integers beyond 64
bits, NaN and ±Infinity, deep nesting, any unicode) as JSON, byte for byte orjson's text wherever
orjson writes it: NaN and ±Infinity as null, big integers exact."""

from __future__ import annotations

import json
import math

import httpx
import orjson
import pytest
from fastapi.exceptions import RequestValidationError
from gateway_fixtures import gateway  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.gateway.jsonbytes import _dumps, dumps
from tracetrain.gateway.schemas import ChatCompletionIn
from tracetrain.gateway.turn import parse_json_body

BIG = 2**70 + 1  # beyond 64 bits, and not a float exactly

_leaf = (
    st.none() | st.booleans() | st.floats() | st.text(max_size=8)
    | st.integers() | st.integers(-(2**64) - 2, 2**64 + 1)  # around orjson's limits
    | st.integers(-(2**200), 2**200) | st.sampled_from([2**63 - 1, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1])
)
json_values = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=24,
)


def nest(value, depth: int, kind: str):
    for k in range(depth):
        value = [value, k] if kind == "list" else {"k": value, "n": k}
    return value


deep_values = st.builds(nest, json_values, st.integers(200, 700), st.sampled_from(["list", "dict"]))


def as_written(value):
    """What JSON can say of `value`: NaN and ±Infinity are null, a tuple is a list."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [as_written(v) for v in value]
    if isinstance(value, dict):
        return {k: as_written(v) for k, v in value.items()}
    return value


def strict_loads(raw: bytes):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def assert_written(value) -> None:
    for sort_keys in (False, True):
        option = orjson.OPT_SORT_KEYS if sort_keys else None
        out = dumps(value, sort_keys=sort_keys)
        assert strict_loads(out) == as_written(value)
        try:
            want = orjson.dumps(value, option=option)
        except TypeError:  # a big integer, or deeper than orjson writes: the fallback's alone
            continue
        assert out == want
        assert _dumps(value, option) == want  # the fallback writes orjson's text, byte for byte


@settings(max_examples=400)
@given(json_values | deep_values)
def test_dumps_writes_any_json_like_value_as_orjson_would(value):
    assert_written(value)


@settings(max_examples=200)
@given(json_values)
def test_a_value_in_a_body_the_gateway_accepted_is_written_back(value):
    """The chat route's parse of a body holding the value (in JSON with NaN/Infinity tokens, as
    a client's json.dumps writes it), then dumps of what it parsed, as the gateway stores it."""
    raw = json.dumps({"messages": [{"role": "user", "content": "x", "extra": value}]}).encode()
    try:
        _, data = parse_json_body(ChatCompletionIn, raw)
    except RequestValidationError:
        return  # refused with a 422: nothing to write back
    assert_written(data)


def test_what_orjson_refuses_beyond_numbers_and_depth_is_still_refused():
    for value in ({1: 2}, [BIG, {1: 2}], [BIG, object()], [BIG, "\ud800"], {"\ud800": BIG}):
        with pytest.raises(TypeError):
            dumps(value)


def test_a_chat_body_with_a_big_integer_and_nan_is_served_and_recorded(gateway):  # noqa: F811
    """The fallback used to refuse NaN (the standard library's allow_nan=False): a 500."""
    (r,) = gateway.create(1)
    raw = (
        '{"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": "hi", '
        f'"x": [NaN, {BIG}, -Infinity]}}], "tools": [{{"type": "function", "function": '
        f'{{"name": "f", "parameters": {{"type": "object", "properties": {{"n": {{"type": '
        f'"integer", "maximum": {BIG}, "minimum": -Infinity}}}}}}}}}}]}}'
    )
    got = httpx.post(r["base_url"] + "/chat/completions", content=raw,
                     headers={"Authorization": f"Bearer {r['api_key']}",
                              "Content-Type": "application/json"})
    assert got.status_code == 200, got.text
    (turn,) = gateway.store.get_turns(r["rollout_id"])
    assert strict_loads(turn.messages.encode()) == [
        {"role": "user", "content": "hi", "x": [None, BIG, None]}]
