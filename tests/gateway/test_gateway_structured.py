"""Structured outputs and forced tool choice (render.decoding): on an engine that constrains
decoding (an upstream vLLM, here the fake one) the constraint reaches the server as vLLM's
`structured_outputs` object, on every API; where the engine cannot (the local engine, SGLang) or
the tool parser has no constraint (mistral), a 400 naming the field, and nothing is sent."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_upstream import FakeUpstream
from gateway_fixtures import hermes_call, live_gateway, tiny_tokenizer

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.engines.upstream import UpstreamEngine, request_body
from tracetrain.gateway.tool_calls import PARSERS
from tracetrain.models.tiny import build_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALC = {"type": "object", "properties": {"expr": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "parameters": CALC}}
              for name in ("calc", "other")]
HI = [{"role": "user", "content": "hi"}]
ROUTES = {  # route -> a plain request
    "chat/completions": {"messages": HI, "max_tokens": 128},
    "responses": {"input": "hi", "max_output_tokens": 128},
    "messages": {"messages": HI, "max_tokens": 128},
}
TOOLS = {
    "chat/completions": CHAT_TOOLS,
    "responses": [{"type": "function", "name": t["function"]["name"], "parameters": CALC}
                  for t in CHAT_TOOLS],
    "messages": [{"name": t["function"]["name"], "input_schema": CALC} for t in CHAT_TOOLS],
}
REQUIRED = {"chat/completions": "required", "responses": "required", "messages": {"type": "any"}}
NAMED = {  # the tool "other", in each API's spelling
    "chat/completions": {"type": "function", "function": {"name": "other"}},
    "responses": {"type": "function", "name": "other"},
    "messages": {"type": "tool", "name": "other"},
}


def hermes(tools: list[dict], one: bool) -> dict:
    return PARSERS["hermes"].constraint(tools, one)


# (route, extra request fields, the structured_outputs the server must get)
FORMATS = [
    ("chat/completions", {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "city", "schema": SCHEMA}}},
     {"json": SCHEMA}),
    ("chat/completions", {"response_format": {"type": "json_object"}}, {"json_object": True}),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}},
     {"json": SCHEMA}),
    ("responses", {"text": {"format": {"type": "json_object"}}}, {"json_object": True}),
]
FORCED = [  # required: one or more calls of any tool; named: one call of "other"
    *((route, {"tools": TOOLS[route], "tool_choice": REQUIRED[route]}, hermes(CHAT_TOOLS, False))
      for route in ROUTES),
    *((route, {"tools": TOOLS[route], "tool_choice": NAMED[route]}, hermes(CHAT_TOOLS[1:], True))
      for route in ROUTES),
]
FIELD = {"response_format": "response_format", "text": "text.format", "tool_choice": "tool_choice"}


@pytest.fixture(scope="module")
def fake():
    with FakeUpstream() as f:
        yield f


def upstream(fake, api: str = "vllm") -> UpstreamEngine:
    return UpstreamEngine(fake.url, "fake", tiny_tokenizer(), max_context=2048, api=api)


def post(gw, route: str, body: dict) -> tuple[httpx.Response, str]:
    """The answer to `body` at `route` of a new rollout, and the rollout's id."""
    (r,) = gw.create(1)
    got = httpx.post(f"{r['base_url']}/{route}", json=body, timeout=30,
                     headers={"Authorization": f"Bearer {r['api_key']}"})
    return got, r["rollout_id"]


def call_of(route: str, answer: dict) -> tuple[str, dict] | None:
    """(name, arguments) of the answer's one tool call, in the route's own shape."""
    if route == "chat/completions":
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in answer["choices"][0]["message"].get("tool_calls") or ()]
    elif route == "responses":
        calls = [(o["name"], json.loads(o["arguments"])) for o in answer["output"]
                 if o["type"] == "function_call"]
    else:
        calls = [(b["name"], b["input"]) for b in answer["content"] if b["type"] == "tool_use"]
    return calls[0] if len(calls) == 1 else None


@pytest.mark.parametrize("route, extra, structured", FORMATS + FORCED)
@pytest.mark.parametrize("stream", [False, True])
def test_the_constraint_reaches_vllm_as_structured_outputs(tmp_path, fake, route, extra,
                                                           structured, stream):
    tok = tiny_tokenizer()
    forced = "tool_choice" in extra
    reply = hermes_call("other", {"expr": "1"}) if forced else '{"city": "Paris"}'
    fake.config.replies = [tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]]
    with live_gateway(tmp_path, upstream(fake), close_engines=True) as gw:
        got, rid = post(gw, route, {**ROUTES[route], **extra, "stream": stream})
        assert got.status_code == 200, got.text
        sent = fake.app.state.last_request
        assert sent["structured_outputs"] == structured
        assert sent["stream"] is stream
        if forced and not stream:  # the call is read in the model's format, in the API's shape
            assert call_of(route, got.json()) == ("other", {"expr": "1"})
        if route == "responses" and not forced and not stream:  # the format asked for, echoed
            assert got.json()["text"] == extra["text"]
        (turn,) = gw.store.get_turns(rid)
        assert tok.decode(turn.response_ids, skip_special_tokens=True) == reply


def test_the_structural_tag_is_xgrammars_in_the_hermes_format():
    """The constraint as vLLM reads it: JSON text of {"type": "structural_tag", "format"}, one
    tag per tool and spelling (with and without the newlines); named: exactly one call of it;
    required: one or more, joined by an optional newline."""
    one = json.loads(hermes(CHAT_TOOLS[1:], True)["structural_tag"])
    assert one["type"] == "structural_tag" and one["format"]["type"] == "or"
    assert [(t["begin"], t["end"]) for t in one["format"]["elements"]] == [
        ('<tool_call>\n{"name": "other", "arguments": ', "}\n</tool_call>"),
        ('<tool_call>{"name": "other", "arguments": ', "}</tool_call>"),
    ]
    assert one["format"]["elements"][0]["content"] == {"type": "json_schema", "json_schema": CALC}
    more = json.loads(hermes(CHAT_TOOLS, False)["structural_tag"])["format"]
    assert more["type"] == "sequence" and len(more["elements"][0]["elements"]) == 4
    assert more["elements"][1]["content"]["elements"][0] == {"type": "regex", "pattern": "\n?"}
    llama = json.loads(PARSERS["llama3_json"].constraint(CHAT_TOOLS, False)["structural_tag"])
    assert [t["begin"] for t in llama["format"]["elements"]] == [
        '{"name": "calc", "parameters": ', '{"name": "other", "parameters": ']


def local_engine() -> LocalEngine:
    tok = tiny_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    return LocalEngine(model, tok)


@pytest.mark.parametrize("route, extra, structured", FORMATS + FORCED)
@pytest.mark.parametrize("kind", ["local", "sglang"])
def test_an_engine_that_cannot_constrain_refuses_naming_the_field(tmp_path, fake, route, extra,
                                                                 structured, kind):
    fake.app.state.last_request = None
    engine = local_engine() if kind == "local" else upstream(fake, api="sglang")
    with live_gateway(tmp_path, engine, close_engines=True) as gw:
        got, rid = post(gw, route, {**ROUTES[route], **extra})
        field = FIELD[next(k for k in extra if k != "tools")]
        assert got.status_code == 400, got.text
        error = got.json()["error"]  # Anthropic's shape has no param: the message names it
        assert error.get("param", field) == field and error["message"].startswith(field)
        assert "cannot constrain decoding" in error["message"] and "vLLM" in error["message"]
        assert gw.store.get_turns(rid) == []
    assert fake.app.state.last_request is None


@pytest.mark.parametrize("body, field, words", [
    ({**ROUTES["chat/completions"], "tools": CHAT_TOOLS,
      "response_format": {"type": "json_object"}}, "response_format", "and tools"),
    ({**ROUTES["responses"], "tools": TOOLS["responses"], "tool_choice": "required",
      "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
     "text.format", "and tools"),
    ({**ROUTES["chat/completions"], "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x"}}},
     "response_format", "no schema"),
    ({**ROUTES["chat/completions"], "response_format": {"type": "grammar"}}, "response_format",
     "not text, json_object or json_schema"),
    ({**ROUTES["chat/completions"], "tool_choice": "required"}, "tool_choice", "no tools"),
    ({**ROUTES["chat/completions"], "tools": CHAT_TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({**ROUTES["chat/completions"], "tools": [{"type": "function"}], "tool_choice": "required"},
     "tools", "tools[0]"),
    ({**ROUTES["chat/completions"], "tool_choice": "sometimes"}, "tool_choice", "not one"),
])
def test_requests_that_cannot_be_constrained_as_asked_are_400s(tmp_path, fake, body, field,
                                                               words):
    fake.app.state.last_request = None
    with live_gateway(tmp_path, upstream(fake), close_engines=True) as gw:
        got, _ = post(gw, "chat/completions" if "messages" in body else "responses", body)
    assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
    assert words in got.json()["error"]["message"]
    assert fake.app.state.last_request is None


def test_a_parser_without_a_constraint_refuses_or_serves_as_auto(tmp_path, fake):
    """mistral has no constraint: a forced choice is a 400 even on vLLM, or with as_auto it is
    generated unconstrained; a format is still constrained."""
    body = {**ROUTES["chat/completions"], "tools": CHAT_TOOLS, "tool_choice": "required"}
    fake.config.replies, fake.app.state.last_request = None, None
    with live_gateway(tmp_path, upstream(fake), tool_parser="mistral", close_engines=True) as gw:
        got, _ = post(gw, "chat/completions", body)
        assert got.status_code == 400 and got.json()["error"]["param"] == "tool_choice"
        assert "'mistral' has no constraint" in got.json()["error"]["message"]
        assert fake.app.state.last_request is None
        fmt = {**ROUTES["chat/completions"], "response_format": {"type": "json_object"}}
        assert post(gw, "chat/completions", fmt)[0].status_code == 200
        assert fake.app.state.last_request["structured_outputs"] == {"json_object": True}
    (tmp_path / "auto").mkdir()
    with live_gateway(tmp_path / "auto", upstream(fake), tool_parser="mistral",
                      forced_tool_choice="as_auto", close_engines=True) as gw:
        assert post(gw, "chat/completions", body)[0].status_code == 200
        assert "structured_outputs" not in fake.app.state.last_request


def test_as_auto_still_constrains_where_the_engine_can(tmp_path, fake):
    fake.config.replies = None
    body = {**ROUTES["messages"], "tools": TOOLS["messages"], "tool_choice": NAMED["messages"]}
    with live_gateway(tmp_path, upstream(fake), forced_tool_choice="as_auto",
                      close_engines=True) as gw:
        assert post(gw, "messages", body)[0].status_code == 200
    assert fake.app.state.last_request["structured_outputs"] == hermes(CHAT_TOOLS[1:], True)


def test_sampling_params_carry_the_constraint_only_to_an_engine_that_constrains(fake):
    params = SamplingParams(max_tokens=4, structured={"json_object": True})
    assert request_body("m", [1], params)["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in request_body("m", [1], SamplingParams(max_tokens=4))
    upstream(fake).check([5], params)
    for engine in (local_engine(), upstream(fake, api="sglang")):
        with pytest.raises(ValueError, match="structured is set, but this engine cannot"):
            engine.check([5], params)
    with pytest.raises(ValueError, match="exactly one of json"):
        upstream(fake).check([5], SamplingParams(structured={"json": {}, "regex": "a"}))
