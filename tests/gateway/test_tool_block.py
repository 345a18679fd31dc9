"""Tools reach a model whose chat template drops them: SmolLM2-135M-Instruct's real template behind
a live gateway, driven by the openai SDK (chat and Responses) and the anthropic SDK. The gateway
writes the tool block into the prompt (models/tool_prompt.py), reads the model's Hermes calls back
into each API's shape, renders the results, and the ids recorded are the ids the engine saw."""

from __future__ import annotations

import json
import logging

import anthropic
import pytest
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, live_gateway
from openai import OpenAI

from tracetrain.models.tool_prompt import call_text, chat_text

CALL = call_text({"name": "calc", "arguments": {"expr": "6*7"}})  # as the block asks the model


@pytest.fixture
def smollm2_gateway(tmp_path, caplog):
    import real_tokenizers

    caplog.set_level(logging.INFO, logger="tracetrain.gateway")
    with live_gateway(tmp_path, ScriptedEngine(real_tokenizers.smollm2())) as gw:
        yield gw
        gw.admin.close()


def rendered(tok, messages, tools) -> list[int]:
    """The ids of the template's rendering of the conversation with the tool block."""
    return tok.encode(chat_text(tok, messages, tools, generation_prompt=True, inject=True),
                      add_special_tokens=False)


def test_chat_calls_parse_and_every_prompt_is_the_block_rendering(smollm2_gateway, caplog):
    gw = smollm2_gateway
    tok = gw.engine.tokenizer
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    messages = [{"role": "system", "content": "Use the tool."},
                {"role": "user", "content": "What is 6*7?"}]
    gw.engine.say(CALL)
    first = client.chat.completions.create(model="policy", messages=messages, tools=CALC_TOOLS)
    (tc,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("calc", {"expr": "6*7"})
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": "42"}]
    gw.engine.say("It is 42.")
    second = client.chat.completions.create(model="policy", messages=messages, tools=CALC_TOOLS)
    assert second.choices[0].message.content == "It is 42."

    turns = gw.store.get_turns(r["rollout_id"])
    assert [t.context for t in turns] == ["rendered", "exact"]
    assert [list(p) for p, _ in gw.engine.calls] == [t.prompt_ids for t in turns]  # what it saw
    assert turns[0].prompt_ids == rendered(tok, messages[:2], CALC_TOOLS)
    # the earlier turn's ids continued: here they are also the block's full rendering
    assert turns[1].prompt_ids == rendered(tok, messages, CALC_TOOLS)
    logged = caplog.get_records("setup") + caplog.get_records("call")  # said when it starts
    said = [m.getMessage() for m in logged if "does not render tools" in m.getMessage()]
    assert len(said) == 1 and "hermes" in said[0]


def test_responses_and_anthropic_messages_get_the_calls_too(smollm2_gateway):
    gw = smollm2_gateway
    tok = gw.engine.tokenizer
    a, b = gw.create(2)
    gw.engine.say("I will compute it.\n" + CALL)
    out = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0).responses.create(
        model="policy", input="What is 6*7?", tools=[{"type": "function", **CALC_TOOLS[0]["function"]}])
    assert [o.type for o in out.output] == ["message", "function_call"]
    assert out.output_text == "I will compute it."
    assert (out.output[1].name, json.loads(out.output[1].arguments)) == ("calc", {"expr": "6*7"})
    (turn,) = gw.store.get_turns(a["rollout_id"])
    assert "<tools>\n" + json.dumps(CALC_TOOLS[0]) in tok.decode(turn.prompt_ids)

    gw.engine.say(CALL)
    c = anthropic.Anthropic(base_url=b["base_url"].removesuffix("/v1"), api_key=b["api_key"],
                            max_retries=0)
    tools = [{"name": "calc", "description": CALC_TOOLS[0]["function"]["description"],
              "input_schema": CALC_TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "What is 6*7?"}]
    first = c.messages.create(model="policy", max_tokens=200, messages=messages, tools=tools)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert (use.type, use.name, use.input) == ("tool_use", "calc", {"expr": "6*7"})
    messages += [
        {"role": "assistant", "content": [x.model_dump(exclude_none=True) for x in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]
    gw.engine.say("It is 42.")
    second = c.messages.create(model="policy", max_tokens=200, messages=messages, tools=tools)
    assert second.content[0].text == "It is 42."
    turns = gw.store.get_turns(b["rollout_id"])
    assert [t.context for t in turns] == ["rendered", "exact"]
    assert turns[1].prompt_ids[: len(turns[0].prompt_ids) + len(turns[0].response_ids)] == (
        turns[0].prompt_ids + turns[0].response_ids)
    assert tok.decode(turns[1].prompt_ids).endswith(
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("setting", ["off", "llama3_json"])
def test_off_and_other_formats_never_write_the_block(tmp_path, setting):
    import real_tokenizers

    engine = ScriptedEngine(real_tokenizers.smollm2())
    with live_gateway(tmp_path, engine, tool_parser=setting) as gw:
        (r,) = gw.create(1)
        engine.say("Hi.")
        OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hi"}], tools=CALC_TOOLS)
        (turn,) = gw.store.get_turns(r["rollout_id"])
        assert "<tools>" not in engine.tokenizer.decode(turn.prompt_ids)
        gw.admin.close()
