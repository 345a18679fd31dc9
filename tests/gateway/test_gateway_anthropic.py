"""The Anthropic Messages API on a rollout (gateway/anthropic_routes.py), driven by the real
`anthropic` SDK through a live gateway on loopback with a scripted engine: tool_use reaches the
harness, tool_result comes back, every turn is recorded with exact ids (one row under
`context: exact`), errors come in Anthropic's shape naming the field, and nothing is recorded for
a refused request."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from gateway_fixtures import ScriptedEngine, hermes_call, live_gateway

from tracetrain.rows.aggregate import aggregate

TOOLS = [
    {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}},
    }
]




def client(r) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=r["base_url"].removesuffix("/v1"), api_key=r["api_key"],
                               max_retries=0)


@pytest.fixture
def gw(tmp_path):
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        yield gw
        gw.admin.close()


def test_tool_use_round_trip_plain_and_streaming(gw):
    (r,) = gw.create(1)
    c = client(r)  # the key goes as x-api-key, the SDK's default
    gw.engine.say("Let me compute. " + hermes_call("calc", {"expr": "6*7"}))
    messages = [{"role": "user", "content": "What is 6*7?"}]
    first = c.messages.create(model="policy", max_tokens=200, system="Use the tool.",
                              messages=messages, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert (use.name, use.input) == ("calc", {"expr": "6*7"})
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]
    gw.engine.say("It is 42.")
    with c.messages.stream(model="policy", max_tokens=200, system="Use the tool.",
                           messages=messages, tools=TOOLS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "It is 42." and final.stop_reason == "end_turn"
    turns = gw.store.get_turns(r["rollout_id"])
    assert [(t.context, t.context_reason) for t in turns] == [("rendered", "first_turn"),
                                                             ("exact", None)]
    assert [t.response_ids for t in turns] == [g.response_ids for _, g in gw.engine.calls]
    assert final.usage.input_tokens == len(turns[1].prompt_ids)
    assert final.usage.output_tokens == len(turns[1].response_ids)
    gw.admin.patch(f"/rollouts/{r['rollout_id']}", json={"state": "succeeded"})
    _, metrics = aggregate(gw.store.load_rollouts(rollout_ids=[r["rollout_id"]]),
                           max_prompt_length=4096, max_response_length=4096, pad_token_id=0,
                           tokenizer=gw.engine.tokenizer)
    assert metrics["n_rows"] == 1


def test_stop_reasons_and_a_bearer_key(gw):
    (r,) = gw.create(1)
    c = anthropic.Anthropic(base_url=r["base_url"].removesuffix("/v1"), max_retries=0,
                            auth_token=r["api_key"])  # Authorization: Bearer
    gw.engine.say("one two three four five six", eos=False)
    cut = c.messages.create(model="policy", max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    tok = gw.engine.tokenizer
    (dot,) = tok.encode(".", add_special_tokens=False)
    words = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    gw.engine.script.append(words("Done") + [dot] + words(" More"))
    stopped = c.messages.create(model="policy", max_tokens=50, stop_sequences=["."],
                                messages=[{"role": "user", "content": "go"}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", ".")
    assert stopped.content[0].text == "Done"  # the stop sequence is not part of the text
    assert gw.store.get_turns(r["rollout_id"])[-1].response_ids == words("Done") + [dot]


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}]}, 400,
         "messages[0].content[0].tool_use_id"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "mystery"}]}]}, 422,
         "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 422, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, 422, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"name": "f"}]}, 422, "tools"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
          "stop_sequences": ["end", ""]}, 400, "stop_sequences"),
    ],
)
def test_bad_input_is_an_anthropic_error_naming_the_field(gw, body, status, field):
    (r,) = gw.create(1)
    got = httpx.post(r["base_url"] + "/messages", json=body, headers={"x-api-key": r["api_key"]})
    assert got.status_code == status, got.text
    error = got.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"], error
    assert gw.store.get_turns(r["rollout_id"]) == [] and gw.engine.calls == []


def test_a_missing_or_wrong_key_is_an_authentication_error(gw):
    (r,) = gw.create(1)
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"x-api-key": "tt-wrong"}):
        got = httpx.post(r["base_url"] + "/messages", json=body, headers=headers)
        assert got.status_code == 401
        assert got.json()["error"]["type"] == "authentication_error"


def test_a_tool_use_input_beyond_64_bit_integers_is_served(gw):
    """JSON has no integer limit; orjson has one (64 bits): the conversation still renders."""
    (r,) = gw.create(1)
    gw.engine.say("ok")
    body = {"max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {"a": 2**70}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]},
    ]}
    got = httpx.post(r["base_url"] + "/messages", json=body, headers={"x-api-key": r["api_key"]})
    assert got.status_code == 200, got.text
    assert str(2**70) in gw.engine.tokenizer.decode(gw.store.get_turns(r["rollout_id"])[0].prompt_ids)
