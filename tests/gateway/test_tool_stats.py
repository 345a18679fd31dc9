"""Per-turn tool stats (gateway/tool_calls.py `opened`, `tool_stats`): each parser counts the calls
an answer began, and the gateway records, with every turn offered tools whose calls it parsed,
the calls parsed, the begun calls that did not parse and the calls of tools not offered (NULL
when no tools were offered, or tool_choice none)."""

from __future__ import annotations

import json

import pytest
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, hermes_call, live_gateway
from openai import OpenAI

from tracetrain.gateway.tool_calls import PARSERS, tool_stats
from tracetrain.types import ToolStats

GOOD = hermes_call("calc", {"expr": "6*7"})
MALFORMED = "<tool_call>{not json}</tool_call>"
UNKNOWN = hermes_call("nope", {})
LLAMA = json.dumps({"name": "calc", "parameters": {"expr": "1+1"}})


def stats(parser: str, text: str, tools=CALC_TOOLS) -> ToolStats:
    p = PARSERS[parser]
    _content, calls = p.parse(text)
    return tool_stats(p, text, calls, tools)


@pytest.mark.parametrize("parser, text, expected", [
    # hermes: every <tool_call> begins a call; those beyond the parsed ones failed
    ("hermes", "Let me see. " + GOOD, (1, 0, 0)),
    ("hermes", GOOD + "\n" + MALFORMED + "\n" + UNKNOWN, (2, 1, 1)),
    ("hermes", MALFORMED + MALFORMED, (0, 2, 0)),
    ("hermes", GOOD + '<tool_call>{"name": "calc", "argu', (1, 1, 0)),  # cut off by max_tokens
    ("hermes", "<tool_call>" + json.dumps({"arguments": {}}) + "</tool_call>", (0, 1, 0)),  # no name
    ("hermes", "It is 42.", (0, 0, 0)),
    # llama3_json: an answer that begins like a call ("{" or <|python_tag|>) but gave none failed
    ("llama3_json", LLAMA, (1, 0, 0)),
    ("llama3_json", "<|python_tag|>" + LLAMA + "; " + json.dumps({"name": "nope", "parameters": {}}),
     (2, 0, 1)),
    ("llama3_json", '  {"name": "calc", "parameters": {"expr": ', (0, 1, 0)),
    ("llama3_json", "<|python_tag|>print(42)", (0, 1, 0)),
    ("llama3_json", "The answer is {42}.", (0, 0, 0)),
    # mistral: [TOOL_CALLS] present but no call parsed failed
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": "calc", "arguments": {"expr": "2"}}]), (1, 0, 0)),
    ("mistral", "Sure.[TOOL_CALLS]nope[ARGS]{}", (1, 0, 1)),
    ("mistral", '[TOOL_CALLS][{"name": "calc", "arguments": {', (0, 1, 0)),
    ("mistral", "no call here", (0, 0, 0)),
])
def test_each_parser_counts_calls_failures_and_unknown_tools(parser, text, expected):
    assert stats(parser, text) == ToolStats(*expected)


def test_opened_counts_what_the_text_began_and_no_tools_makes_every_call_unknown():
    assert PARSERS["hermes"].opened(GOOD + MALFORMED + UNKNOWN) == 3
    assert PARSERS["llama3_json"].opened("\n<|python_tag|>x") == 1
    assert PARSERS["mistral"].opened("a [TOOL_CALLS] b [TOOL_CALLS]") == 1
    assert stats("hermes", GOOD + UNKNOWN, tools=None) == ToolStats(2, 0, 2)
    # tools as some harnesses send them (a name missing) count only the names given
    assert stats("hermes", GOOD, tools=[{"type": "function", "function": {}}]) == ToolStats(1, 0, 1)


def test_the_gateway_records_each_turns_tool_stats(tmp_path):
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        ask = [{"role": "user", "content": "What is 6*7?"}]
        gw.engine.say("I will compute it.\n" + GOOD + "\n" + MALFORMED + "\n" + UNKNOWN)
        out = client.chat.completions.create(model="policy", messages=ask, tools=CALC_TOOLS)
        assert [c.function.name for c in out.choices[0].message.tool_calls] == ["calc", "nope"]
        gw.engine.say("It is 42." + '<tool_call>{"name": "calc"')  # streamed, a call cut off
        chunks = client.chat.completions.create(model="policy", messages=ask, tools=CALC_TOOLS,
                                                stream=True)
        assert all(not c.choices or not c.choices[0].delta.tool_calls for c in chunks)
        gw.engine.say(GOOD)  # no tools offered: nothing parsed, nothing counted
        client.chat.completions.create(model="policy", messages=ask)
        gw.engine.say(GOOD)  # tool_choice none: the answer stays text
        client.chat.completions.create(model="policy", messages=ask, tools=CALC_TOOLS,
                                       tool_choice="none")
        gw.engine.say("Forty-two.")
        client.chat.completions.create(model="policy", messages=ask, tools=CALC_TOOLS)

        turns = gw.store.get_turns(r["rollout_id"])
        assert [t.tools for t in turns] == [ToolStats(2, 1, 1), ToolStats(0, 1, 0), None, None,
                                            ToolStats(0, 0, 0)]
        rows = gw.store._reader().execute(
            "SELECT tool_calls, tool_parse_failures, tool_unknown FROM turns WHERE rollout_id = ?"
            " ORDER BY idx", (r["rollout_id"],)).fetchall()
        assert rows == [(2, 1, 1), (0, 1, 0), (None, None, None), (None, None, None), (0, 0, 0)]
        gw.admin.close()
