"""Tool calls in the model's own format (gateway/tool_calls.py): each parser reads back any call
written in its format (property test), leaves malformed calls as text, is chosen from the chat
template, and serves the gateway end to end (the openai SDK sees the call; the next turn continues
the ids exactly), the special-token markers (Mistral's [TOOL_CALLS]) included."""

from __future__ import annotations

import copy
import json

import pytest
from chat_templates import HERMES_TOOLS, LLAMA3_JSON_TOOLS, MISTRAL_TOOLS, with_template
from gateway_fixtures import ScriptedEngine, live_gateway, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from tracetrain.gateway.tool_calls import PARSERS, parser_for

names = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(";[]{}<>\\\"' abcé", max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def written(fmt: str, wanted: list[tuple[str, dict]], text: str) -> str:
    """`wanted` calls as a model trained on `fmt` writes them, after `text`."""
    if fmt == "hermes":
        blocks = [f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in wanted]
        return text + "\n".join(blocks)
    if fmt == "llama3_json":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in wanted)
    if fmt == "mistral_list":
        return text + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in wanted])
    return text + "[TOOL_CALLS]" + "".join(f"{n}[ARGS]{json.dumps(a)}" for n, a in wanted)


@settings(max_examples=200, deadline=None)
@given(fmt=st.sampled_from(["hermes", "llama3_json", "mistral_list", "mistral_args"]),
       wanted=calls, text=st.text("abc xyz.,!", max_size=20))
def test_each_parser_reads_back_any_call_in_its_format(fmt, wanted, text):
    parser = PARSERS["mistral" if fmt.startswith("mistral") else fmt]
    content, got = parser.parse(written(fmt, wanted, text))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == wanted
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    if fmt != "llama3_json":
        assert content == (text.rstrip() or None)


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Sure. <tool_call>{"name": "calc", "arguments": {"expr": 1+2}</tool_call>'),
    ("hermes", "<tool_call>[1, 2]</tool_call>"),
    ("llama3_json", '{"parameters": {"x": 1}}'),
    ("llama3_json", "The answer is {not json}"),
    ("mistral", "[TOOL_CALLS][{\"name\": \"calc\", \"arguments\": {\"x\": 1}"),
    ("mistral", "[TOOL_CALLS]calc[ARGS]{broken"),
    ("mistral", "no call at all"),
])
def test_a_malformed_call_stays_text(name, text):
    assert PARSERS[name].parse(text) == (text, [])


def test_the_parser_is_chosen_from_the_template():
    assert parser_for("auto", HERMES_TOOLS).name == "hermes"
    assert parser_for("auto", LLAMA3_JSON_TOOLS).name == "llama3_json"
    assert parser_for("auto", MISTRAL_TOOLS).name == "mistral"
    assert parser_for("auto", "{{ messages }}").name == "hermes"  # the default
    assert parser_for("mistral", HERMES_TOOLS).name == "mistral"  # a named one wins
    with pytest.raises(ValueError, match="unknown"):
        parser_for("pythonic", HERMES_TOOLS)


TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}]


def mistral_tokenizer():
    """The tiny tokenizer with Mistral's markers as special tokens (they must survive decoding)."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    return with_template(tok, MISTRAL_TOOLS)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral_list", "mistral_args"])
def test_through_the_gateway(tmp_path, fmt):
    tok = (mistral_tokenizer() if fmt.startswith("mistral")
           else with_template(tiny_tokenizer(), LLAMA3_JSON_TOOLS))
    engine = ScriptedEngine(tok)
    answer = written(fmt, [("calc", {"expr": "6*7"})], "")
    engine.script.append(tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id])
    engine.script.append(tok.encode("It is 42.", add_special_tokens=False) + [tok.eos_token_id])
    if fmt.startswith("mistral"):  # the markers are single special tokens in this tokenizer
        assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in engine.script[0]
    with live_gateway(tmp_path, engine) as gw:
        (r,) = gw.create(1)
        client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "What is 6*7?"}]
        out = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        (tc,) = out.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("calc", {"expr": "6*7"})
        assert out.choices[0].finish_reason == "tool_calls"
        messages += [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "42"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "It is 42."
        turns = gw.store.get_turns(r["rollout_id"])
    assert turns[1].context == "exact"
    before = turns[0].prompt_ids + turns[0].response_ids
    assert turns[1].prompt_ids[: len(before)] == before


# ------------------------------------------------------------------------------ tool_choice

HERMES_CALL = "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": "1"}}) + "</tool_call>"
CHOICES = {  # route -> (body without tool_choice, none, forcing choices)
    "chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
                         "none", ["required", {"type": "function", "function": {"name": "calc"}}]),
    "responses": ({"input": "hi", "tools": [{"type": "function", "name": "calc", "parameters": {}}]},
                  "none", ["required", {"type": "function", "name": "calc"}]),
    "messages": ({"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                  "tools": [{"name": "calc", "input_schema": {"type": "object"}}]},
                 {"type": "none"}, [{"type": "any"}, {"type": "tool", "name": "calc"}]),
}


@pytest.mark.parametrize("route", list(CHOICES))
def test_tool_choice_none_leaves_text_and_forcing_a_call_is_refused(tmp_path, route):
    import httpx

    body, none, forcing = CHOICES[route]
    engine = ScriptedEngine()
    tok = engine.tokenizer
    with live_gateway(tmp_path, engine) as gw:
        (r,) = gw.create(1)
        headers = {"Authorization": f"Bearer {r['api_key']}"}
        url = f"{r['base_url']}/{route}"
        for choice in forcing:  # refused before any generation, naming the field
            got = httpx.post(url, json={**body, "tool_choice": choice}, headers=headers)
            assert got.status_code == 400, got.text
            assert "tool_choice" in got.text and "forces a tool call" in got.text
        assert engine.calls == [] and gw.store.get_turns(r["rollout_id"]) == []
        for choice, parsed in ((none, False), (None, True)):
            engine.script.append(tok.encode(HERMES_CALL, add_special_tokens=False) + [tok.eos_token_id])
            extra = {} if choice is None else {"tool_choice": choice}
            got = httpx.post(url, json={**body, **extra}, headers=headers)
            assert got.status_code == 200, got.text
            assert called(route, got.json()) == parsed, got.text


def called(route: str, answer: dict) -> bool:
    """Whether the answer carries a parsed tool call, in the route's own shape."""
    if route == "chat/completions":
        return bool(answer["choices"][0]["message"].get("tool_calls"))
    if route == "responses":
        return any(o["type"] == "function_call" for o in answer["output"])
    return any(b["type"] == "tool_use" for b in answer["content"])


@pytest.mark.parametrize("route, body, field", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format"),
])
def test_structured_output_is_refused_not_faked(tmp_path, route, body, field):
    import httpx

    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        (r,) = gw.create(1)
        headers = {"Authorization": f"Bearer {r['api_key']}"}
        got = httpx.post(f"{r['base_url']}/{route}", json=body, headers=headers)
        assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
        ok = {**body, **({"response_format": {"type": "text"}} if "messages" in body
                         else {"text": {"format": {"type": "text"}}})}
        gw.engine.script.append([5, gw.engine.tokenizer.eos_token_id])
        assert httpx.post(f"{r['base_url']}/{route}", json=ok, headers=headers).status_code == 200
        assert len(gw.store.get_turns(r["rollout_id"])) == 1


@pytest.mark.parametrize("route", list(CHOICES))
def test_a_gateway_set_to_as_auto_serves_a_forced_choice_as_auto(tmp_path, route):
    import httpx

    body, _, forcing = CHOICES[route]
    engine = ScriptedEngine()
    tok = engine.tokenizer
    with live_gateway(tmp_path, engine, forced_tool_choice="as_auto") as gw:
        (r,) = gw.create(1)
        for choice in forcing:
            engine.script.append(tok.encode(HERMES_CALL, add_special_tokens=False) + [tok.eos_token_id])
            got = httpx.post(f"{r['base_url']}/{route}", json={**body, "tool_choice": choice},
                             headers={"Authorization": f"Bearer {r['api_key']}"})
            assert got.status_code == 200 and called(route, got.json()), got.text
