"""The OpenAI Responses API on a rollout (gateway/responses_routes.py), driven by the real `openai`
SDK and the OpenAI Agents SDK at its defaults (which call POST /v1/responses), through a live
gateway on loopback with a scripted engine: tool calls reach the harness, tool results come back,
every turn is recorded with exact ids, and under `context: exact` the rollout is one row."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from gateway_fixtures import ScriptedEngine, hermes_call, live_gateway
from openai import AsyncOpenAI, OpenAI

from tracetrain.rows.aggregate import aggregate

TOOLS = [
    {
        "type": "function",
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    }
]




def one_row(gw, rollout_id: str) -> int:
    gw.admin.patch(f"/rollouts/{rollout_id}", json={"state": "succeeded"})
    rollouts = gw.store.load_rollouts(rollout_ids=[rollout_id])
    _, metrics = aggregate(rollouts, max_prompt_length=4096, max_response_length=4096,
                           pad_token_id=0, tokenizer=gw.engine.tokenizer)
    return metrics["n_rows"]


@pytest.fixture
def gw(tmp_path):
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        yield gw
        gw.admin.close()


def test_a_tool_call_round_trip_is_recorded_exactly(gw):
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    gw.engine.say("Let me compute. " + hermes_call("calc", {"expr": "6*7"}))
    first = client.responses.create(model="policy", input="What is 6*7?",
                                    instructions="Use the tool.", tools=TOOLS)
    assert [o.type for o in first.output] == ["message", "function_call"]
    fc = first.output[1]
    assert (fc.name, json.loads(fc.arguments)) == ("calc", {"expr": "6*7"})
    assert first.output_text == "Let me compute."
    # The harness sends the whole conversation back, output items as the SDK gave them.
    items = [{"role": "user", "content": "What is 6*7?"}]
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "42"})
    gw.engine.say("It is 42.")
    second = client.responses.create(model="policy", input=items, instructions="Use the tool.",
                                     tools=TOOLS)
    assert second.output_text == "It is 42." and second.status == "completed"
    turns = gw.store.get_turns(r["rollout_id"])
    assert [(t.context, t.context_reason) for t in turns] == [("rendered", "first_turn"),
                                                             ("exact", None)]
    assert [t.response_ids for t in turns] == [g.response_ids for _, g in gw.engine.calls]
    assert second.usage.input_tokens == len(turns[1].prompt_ids)
    assert second.usage.output_tokens == len(turns[1].response_ids)
    text = gw.engine.tokenizer.decode(turns[1].prompt_ids)
    assert "Use the tool." in text and "42" in text
    assert one_row(gw, r["rollout_id"]) == 1


def test_streaming_and_previous_response_id(gw):
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    gw.engine.say(hermes_call("calc", {"expr": "2+2"}))
    events = list(client.responses.create(model="policy", input="2+2?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    (fc,) = done.output
    gw.engine.say("Four.")
    with client.responses.stream(
        model="policy", previous_response_id=done.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "4"}],
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Four."
    turns = gw.store.get_turns(r["rollout_id"])
    assert turns[1].context == "exact"
    before = turns[0].prompt_ids + turns[0].response_ids
    assert turns[1].prompt_ids[: len(before)] == before


def test_the_agents_sdk_at_its_defaults(gw):
    import agents
    agents.set_tracing_disabled(True)  # its default exports traces to OpenAI: not from tests
    (r,) = gw.create(1)
    seen = []

    @agents.function_tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expr)
        return str(eval(expr, {}, {}))

    async def main():
        client = AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agent = agents.Agent(name="calc", instructions="Use calc.", tools=[calc], model="policy")
        gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
        gw.engine.say("It is 42.")
        ran = await agents.Runner.run(agent, "What is 6*7?")
        gw.engine.say(hermes_call("calc", {"expr": "2+2"}))
        gw.engine.say("It is 4.")
        streamed = agents.Runner.run_streamed(agent, "What is 2+2?")
        kinds = {e.type async for e in streamed.stream_events()}
        return ran.final_output, streamed.final_output, kinds

    ran, streamed, kinds = asyncio.run(main())
    assert (ran, streamed) == ("It is 42.", "It is 4.")
    assert seen == ["6*7", "2+2"]  # the framework ran the tool the model called
    assert "raw_response_event" in kinds
    turns = gw.store.get_turns(r["rollout_id"])
    # Two runs of two calls each: each run's second call continues its first exactly.
    assert [(t.context, t.context_reason) for t in turns] == [
        ("rendered", "first_turn"), ("exact", None), ("rendered", "no_match"), ("exact", None)]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, 400,
         "input[0].call_id"),
        ({"input": [{"type": "mystery", "x": 1}]}, 422, "input"),
        ({"input": [{"role": "user", "content": 5}]}, 422, "input"),
        ({"input": "hi", "tools": [{"type": "function"}]}, 422, "tools"),
        ({"input": "hi", "max_output_tokens": 0}, 422, "max_output_tokens"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_records_nothing(gw, body, status, param):
    (r,) = gw.create(1)
    got = httpx.post(r["base_url"] + "/responses", json={"model": "policy", **body},
                     headers={"Authorization": f"Bearer {r['api_key']}"})
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert gw.store.get_turns(r["rollout_id"]) == [] and gw.engine.calls == []


def test_a_response_of_another_rollout_is_not_found(gw):
    a, b = gw.create(2)
    gw.engine.say("Hello.")
    out = OpenAI(base_url=a["base_url"], api_key=a["api_key"]).responses.create(
        model="policy", input="hi")
    got = httpx.post(b["base_url"] + "/responses",
                     json={"input": "again", "previous_response_id": out.id},
                     headers={"Authorization": f"Bearer {b['api_key']}"})
    assert got.status_code == 404 and got.json()["error"]["param"] == "previous_response_id"


def test_integers_beyond_64_bits_are_answered_and_kept_exactly(gw):
    """JSON allows any integer; orjson writes none beyond 64 bits. A tool schema holding one is
    echoed back as sent (found by the fuzz test as a 500), and a tool call whose arguments hold
    one (the model wrote it) reaches the harness exactly."""
    huge = -9223372036854775809  # one below int64's range
    tools = [{"type": "function", "name": "calc", "description": None,
              "parameters": {"type": "object", "maximum": huge}}]
    (r,) = gw.create(1)
    gw.engine.say(hermes_call("calc", {"n": 2**70}))
    raw = b'{"model": "policy", "input": "hi", "tools": %s}' % json.dumps(tools).encode()
    got = httpx.post(r["base_url"] + "/responses", content=raw, timeout=30,
                     headers={"Authorization": f"Bearer {r['api_key']}",
                              "Content-Type": "application/json"})
    assert got.status_code == 200, got.text
    body = json.loads(got.content)  # the standard library reads every integer exactly
    assert body["tools"][0]["parameters"]["maximum"] == huge
    (call,) = [o for o in body["output"] if o["type"] == "function_call"]
    assert json.loads(call["arguments"]) == {"n": 2**70}
