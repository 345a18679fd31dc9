"""Chat-template conformance: real tokenizers and templates, one tool-using conversation, both
context policies, through a live gateway and the openai SDK.

Tokenizers (tests/support/real_tokenizers.py): SmolLM2-135M-Instruct (GGUF, with its own template), Qwen
(tiktoken ranks), DeepSeek (tokenizer.json), and the project's tiny one. Templates
(tests/support/chat_templates.py): ChatML with Hermes tool calls, one that drops the reasoning of earlier
turns, one with a default system prompt and the date, a DeepSeek-R1-style one, SmolLM2's own.

The model's answers are scripted token ids, each chosen to exercise one known cause of a prefix
break when the prompt is re-rendered by the template:

    1. a tool call in compact JSON        the template re-serializes it      assistant_rewrite
    2. a tool call written as the         nothing to change                  none
       template writes one
    3. text, ids not the canonical        re-encoding gives other ids         retokenization
       tokenization (one piece per char)
    4. <think>reasoning</think> answer,   a template that drops earlier       assistant_rewrite
       then a user message                 reasoning removes it               (others: none)
    5. a plain answer

SmolLM2's own template drops tools: the gateway writes them in (models/tool_prompt.py), and its
calls and results are the Hermes ones. Under `exact` the conversation is one row with no break;
under `template` the breaks are exactly the expected ones, each classified as its cause.
"""

from __future__ import annotations

import json

import pytest
from chat_templates import (
    DEFAULT_SYSTEM_DATE,
    DROPS_OLD_REASONING,
    HERMES_TOOLS,
    R1_STYLE,
    with_template,
)
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, live_gateway, tiny_tokenizer
from openai import OpenAI

from tracetrain.rows.aggregate import aggregate

TOOLS = CALC_TOOLS


def _tokenizer(name: str):
    if name == "tiny":
        return tiny_tokenizer()
    import real_tokenizers

    try:
        return getattr(real_tokenizers, name)()
    except real_tokenizers.MissingPackage as e:
        pytest.fail(f"{e} (scripts/test.sh installs it)")


# (tokenizer, template name, template or None for the tokenizer's own, how it renders tool calls,
# which reasoning it drops)
CASES = [
    ("tiny", "hermes_tools", HERMES_TOOLS, "hermes", None),
    ("tiny", "drops_old_reasoning", DROPS_OLD_REASONING, "hermes", "before_last_user"),
    ("tiny", "default_system_date", DEFAULT_SYSTEM_DATE, "hermes", None),
    ("smollm2", "own", None, "hermes", None),  # drops tools: the gateway's tool block (hermes)
    ("smollm2", "hermes_tools", HERMES_TOOLS, "hermes", None),
    ("smollm2", "drops_old_reasoning", DROPS_OLD_REASONING, "hermes", "before_last_user"),
    ("smollm2", "default_system_date", DEFAULT_SYSTEM_DATE, "hermes", None),
    ("qwen", "hermes_tools", HERMES_TOOLS, "hermes", None),
    ("qwen", "drops_old_reasoning", DROPS_OLD_REASONING, "hermes", "before_last_user"),
    ("qwen", "default_system_date", DEFAULT_SYSTEM_DATE, "hermes", None),
    ("deepseek", "r1_style", R1_STYLE, "inline", "all"),
]


def as_template_writes(args: dict, style: str) -> str:
    call = '{"name": "calc", "arguments": ' + json.dumps(args) + "}"
    return f"<tool_call>\n{call}\n</tool_call>" if style == "hermes" else f"<tool_call>{call}</tool_call>"


def script(tok, tool_style: str | None) -> list[tuple[list[int], str]]:
    """(ids of the answer, what the harness sends next: "tool" results or a "user" message)."""
    eos = [tok.eos_token_id]

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    compact = '<tool_call>{"name":"calc","arguments":{"expr":"6*7"}}</tool_call>'
    written = as_template_writes({"expr": "42+8"}, tool_style or "hermes")
    spelled = [i for ch in "The sum is fifty." for i in ids(ch)]
    assert spelled != ids("The sum is fifty.")  # not the canonical tokenization
    return [
        (ids(compact) + eos, "tool"),
        (ids(written) + eos, "tool"),
        (spelled + eos, "user"),
        (ids("<think>Check: 6*7+8 is 50.</think>So it is 50.") + eos, "user"),
        (ids("Done.") + eos, "end"),
    ]


def expected_breaks(tool_style: str | None, drops: str | None) -> list[tuple[int, str]]:
    """(turn index, kind) of the breaks under `template`, by the causes in the docstring."""
    out = [(1, "assistant_rewrite")]  # answer 1 re-serialized (or dropped)
    out.append((3, "retokenization"))
    if drops is not None:
        out.append((4, "assistant_rewrite"))
    return out


def converse(gw) -> str:
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "What is 6*7+8? Use the tool."}]
    for ids, then in gw.engine.script_plan:
        gw.engine.script.append(ids)
        out = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = out.choices[0].message
        back = message.model_dump(exclude_none=True)
        if message.tool_calls:
            back["content"] = None
        messages.append(back)
        if then == "tool":
            for tc in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": "42"})
        elif then == "user":
            messages.append({"role": "user", "content": "Check it once more."})
    return r["rollout_id"]


@pytest.mark.parametrize(
    "tok_name, name, template, tool_style, drops", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_one_row_under_exact_and_classified_breaks_under_template(
    tmp_path, tok_name, name, template, tool_style, drops
):
    base = _tokenizer(tok_name)
    tok = base if template is None else with_template(base, template)
    assert tok.chat_template, f"{tok_name} has no chat template"
    plan = script(tok, tool_style)
    got = {}
    for policy in ("exact", "template"):
        (tmp_path / policy).mkdir()
        engine = ScriptedEngine(tok)
        engine.script_plan = plan
        with live_gateway(tmp_path / policy, engine, context=policy, pause_wait_s=5) as gw:
            rid = converse(gw)
            turns = gw.store.get_turns(rid)
            gw.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded"})
            rollouts = gw.store.load_rollouts(rollout_ids=[rid])
        _, metrics, breaks = aggregate(rollouts, max_prompt_length=8192, max_response_length=8192,
                                       pad_token_id=0, tokenizer=tok, return_breaks=True)
        got[policy] = (turns, metrics, [(b.turn_index, b.kind) for b in breaks])
        assert [t.response_ids for t in turns] == [ids for ids, _ in plan]

    turns, metrics, breaks = got["exact"]
    assert breaks == [] and metrics["n_rows"] == 1
    assert [t.context for t in turns] == ["rendered"] + ["exact"] * (len(plan) - 1)
    for before, after in zip(turns, turns[1:], strict=False):
        context = before.prompt_ids + before.response_ids
        assert after.prompt_ids[: len(context)] == context

    turns, metrics, breaks = got["template"]
    assert breaks == expected_breaks(tool_style, drops)
    assert metrics["n_rows"] == 1 + len(breaks)
    assert {t.context_reason for t in turns} == {"template"}
