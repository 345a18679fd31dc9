"""Exact context through a live gateway driven by the openai SDK (gateway/context.py).

Under `context: exact` every turn's prompt starts with the previous turn's prompt + response ids,
and its text is the template's rendering of the conversation in which each answer is what the
model generated; under `context: template` the prompt is the template's full render. The fallbacks
(first turn, history edited, template without a prefix-stable rendering, gateway restarted) are
taken, recorded per turn and counted.
"""

from __future__ import annotations

import json
import random
import sqlite3
from contextlib import closing

import pytest
from chat_templates import DROPS_OLD_REASONING, MARKS_LAST_MESSAGE, with_template
from gateway_fixtures import CALC_TOOLS, ScriptedEngine, live_gateway, tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from tracetrain.gateway import create_app
from tracetrain.gateway.serve import ThreadedServer
from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.context_metrics import context_metrics

TOOLS = CALC_TOOLS


def turns_of(gw, rollout_id: str) -> list[dict]:
    r = gw.admin.get(f"/rollouts/{rollout_id}", params={"turns": "true"})
    assert r.status_code == 200, r.text
    return r.json()["turns"]


def full_render_ids(tok, messages, tools) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"])


# --------------------------------------------------------------------------- conversations

_ALPHABET = "abcdefghij klmnop QRST 0123456789 .,:;!?-+*/=()'\n"
texts = st.text(_ALPHABET, min_size=0, max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text("xyz 01", max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text("abcdef", min_size=1, max_size=4), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), json_values, max_size=4)


@st.composite
def replies(draw, with_tools: bool):
    """One model answer: ("text", text) or ("tools", [args, ...]), how its ids are cut, and how the
    harness sends it back."""
    kind = draw(st.sampled_from(["text", "tools"])) if with_tools else "text"
    body = draw(texts) if kind == "text" else draw(st.lists(arguments, min_size=1, max_size=2))
    return {
        "kind": kind,
        "body": body,
        "canonical": draw(st.booleans()),  # else the text's ids are one piece per character
        "eos": draw(st.booleans()),  # else cut by max_tokens: no end-of-turn token
        "model_separators": draw(st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")])),
        "client_separators": draw(st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")])),
        "client_sorts_keys": draw(st.booleans()),
        "client_content": draw(st.sampled_from([None, ""])),  # content of a tool-call message
        "follow_up": draw(texts),
    }


@st.composite
def conversations(draw):
    with_tools = draw(st.booleans())
    return {
        "system": draw(st.none() | texts),
        "user": draw(texts),
        "tools": TOOLS if with_tools else None,
        "turns": draw(st.lists(replies(with_tools), min_size=1, max_size=5)),
        "seed": draw(st.integers(0, 2**16)),
    }


def model_text(reply: dict) -> str:
    if reply["kind"] == "text":
        return reply["body"]
    blocks = [
        "<tool_call>"
        + json.dumps({"name": "calc", "arguments": a}, separators=reply["model_separators"])
        + "</tool_call>"
        for a in reply["body"]
    ]
    return "\n".join(blocks)


def model_ids(tok, reply: dict) -> list[int]:
    text = model_text(reply)
    if reply["canonical"]:
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    if reply["eos"] or not ids:
        ids = ids + [tok.eos_token_id]
    return ids


def shuffled(obj, rng: random.Random):
    """The same JSON value with every object's keys in a random order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [shuffled(v, rng) for v in obj]
    return obj


def play(gw, conversation: dict) -> tuple[str, list[tuple[list[dict], list[int]]]]:
    """Run one conversation through the gateway as a harness would; returns the rollout id and,
    per call, (messages sent, ids the model generated)."""
    tok = gw.engine.tokenizer
    rng = random.Random(conversation["seed"])
    (r,) = gw.create(1)
    client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
    messages: list[dict] = []
    if conversation["system"] is not None:
        messages.append({"role": "system", "content": conversation["system"]})
    messages.append({"role": "user", "content": conversation["user"]})
    calls = []
    extra = {"tools": conversation["tools"]} if conversation["tools"] else {}
    for reply in conversation["turns"]:
        ids = model_ids(tok, reply)
        gw.engine.script.append(ids)
        sent = [dict(m) for m in messages]
        out = client.chat.completions.create(model="policy", messages=messages, **extra)
        calls.append((sent, ids))
        message = out.choices[0].message
        if message.tool_calls:
            back = {"role": "assistant", "content": message.content or reply["client_content"]}
            back["tool_calls"] = []
            for tc in message.tool_calls:
                args = shuffled(json.loads(tc.function.arguments), rng)
                text = json.dumps(
                    args,
                    separators=reply["client_separators"],
                    sort_keys=reply["client_sorts_keys"],
                )
                fn = {"name": tc.function.name, "arguments": text}
                back["tool_calls"].append({"id": tc.id, "type": "function", "function": fn})
            messages.append(back)
            for tc in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": tc.id, "content": reply["follow_up"]}
                )
        else:
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": reply["follow_up"]})
    return r["rollout_id"], calls


@pytest.fixture(scope="module", params=["exact", "template"])
def policy_gateway(request, tmp_path_factory):
    with live_gateway(
        tmp_path_factory.mktemp(request.param), ScriptedEngine(), context=request.param
    ) as gw:
        yield request.param, gw
        gw.admin.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(conversation=conversations())
def test_prompts_continue_exactly_or_equal_the_full_render(policy_gateway, conversation):
    policy, gw = policy_gateway
    tok = gw.engine.tokenizer
    rollout_id, calls = play(gw, conversation)
    turns = turns_of(gw, rollout_id)
    assert len(turns) == len(calls)
    tools = conversation["tools"]
    for k, (turn, (sent, ids)) in enumerate(zip(turns, calls, strict=True)):
        assert turn["response_ids"] == ids
        if policy == "template":
            assert turn["prompt_ids"] == full_render_ids(tok, sent, tools)
            assert (turn["context"], turn["context_reason"]) == ("rendered", "template")
            continue
        if k == 0:
            assert turn["prompt_ids"] == full_render_ids(tok, sent, tools)
            assert (turn["context"], turn["context_reason"]) == ("rendered", "first_turn")
            continue
        before = turns[k - 1]["prompt_ids"] + turns[k - 1]["response_ids"]
        assert turn["prompt_ids"][: len(before)] == before
        assert turn["context"] == "exact" and turn["reused_tokens"] == len(before)
        # ... and the store keeps only the ids it adds to the turn before (reads join them back)
        with closing(sqlite3.connect(gw.store.path)) as conn:
            stored = conn.execute(
                "SELECT length(prompt_ids) / 4, prompt_from FROM turns"
                " WHERE rollout_id = ? AND idx = ?", (rollout_id, k),
            ).fetchone()
        assert stored == (len(turn["prompt_ids"]) - len(before), k - 1)
        # What the model saw, as text: the conversation with every answer exactly as generated
        # (raw tool-call text, a cut-off answer closed by the template) rendered by the template.
        seen = []
        j = 0
        for m in sent:
            if m["role"] == "assistant":
                raw = calls[j][1]
                raw = raw[:-1] if raw[-1] == tok.eos_token_id else raw
                seen.append({"role": "assistant", "content": tok.decode(raw)})
                j += 1
            else:
                seen.append(m)
        want = tok.apply_chat_template(
            seen, add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {})
        )
        assert tok.decode(turn["prompt_ids"], skip_special_tokens=False) == want


# ------------------------------------------------------------------------------ fallbacks


def run_turns(gw, client, messages, replies, edit=None, tools=None):
    """Call the gateway once per reply text, appending the answer and a user message; `edit`
    changes the history before call k (edit(k, messages))."""
    tok = gw.engine.tokenizer
    for k, text in enumerate(replies):
        if edit is not None:
            edit(k, messages)
        gw.engine.script.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
        extra = {"tools": tools} if tools else {}
        out = client.chat.completions.create(model="policy", messages=messages, **extra)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"go on ({k})"})


def test_first_request_work_is_done_when_the_gateway_starts(tmp_path):
    """The prompt encoder's split check, the template's closing probes (with and without tools)
    and the tool format are built at startup; the first requests use them as they are."""
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        slot = gw.app.gateway.slots["default"]
        prompts, exact, tools = slot._prompts, slot._exact, slot._tools
        assert prompts is not None and exact is not None and tools is not None
        assert len(exact._closings) == 2 and all(exact._closings.values())
        (r,) = gw.create(1)
        client = OpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        run_turns(gw, client, [{"role": "user", "content": "hi"}], ["one", "two"], tools=CALC_TOOLS)
        assert (slot._prompts, slot._exact, slot._tools) == (prompts, exact, tools)
        assert len(exact._closings) == 2


def test_each_fallback_is_taken_and_counted(tmp_path):
    engine = ScriptedEngine()
    with live_gateway(tmp_path, engine) as gw:
        (a, b) = gw.create(2)
        # a: extended exactly twice, then the harness edits its first user message.
        client = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "start"}]

        def edit(k, messages):
            if k == 3:
                messages[0]["content"] = "start (edited)"

        run_turns(gw, client, msgs, ["one", "two", "three", "four"], edit)
        got = [(t["context"], t["context_reason"]) for t in turns_of(gw, a["rollout_id"])]
        assert got == [
            ("rendered", "first_turn"),
            ("exact", None),
            ("exact", None),
            ("rendered", "no_match"),
        ]
        # The edited turn's prompt is the template's render of the edited history.
        assert engine.calls[3][0] == full_render_ids(engine.tokenizer, msgs[:-2], None)

        # b: a template whose rendering of earlier messages changes when one is appended.
        gw.engine.tokenizer = with_template(engine.tokenizer, MARKS_LAST_MESSAGE)
        client = OpenAI(base_url=b["base_url"], api_key=b["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "start"}]
        run_turns(gw, client, msgs, ["one", "two"])
        turns = turns_of(gw, b["rollout_id"])
        assert [(t["context"], t["context_reason"]) for t in turns] == [
            ("rendered", "first_turn"),
            ("rendered", "template_prefix"),
        ]
        assert turns[1]["prompt_ids"] == full_render_ids(gw.engine.tokenizer, msgs[:-2], None)
        counts = context_metrics(gw.store.turn_contexts([a["rollout_id"], b["rollout_id"]]))
        reused = [t.reused_tokens for t in gw.store.get_turns(a["rollout_id"])]
    assert counts["context/exact"] == 2
    assert counts["context/rendered/first_turn"] == 2
    assert counts["context/rendered/no_match"] == 1
    assert counts["context/rendered/template_prefix"] == 1
    assert counts["context/reused_tokens"] == sum(reused) > 0


def test_a_restarted_gateway_renders_the_next_turn_in_full(tmp_path):
    engine = ScriptedEngine()
    with live_gateway(tmp_path, engine) as gw:
        (a,) = gw.create(1)
        client = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "start"}]
        run_turns(gw, client, msgs, ["one", "two"])
        # A new gateway process on the same store: it remembers no conversation.
        app = create_app(gw.store, {"default": engine}, admin_key=gw.admin_key)
        with ThreadedServer(app) as server:
            url = f"{server.url}/rollouts/{a['rollout_id']}/v1"
            client = OpenAI(base_url=url, api_key=a["api_key"], max_retries=0)
            run_turns(gw, client, msgs, ["three", "four"])
        got = [(t["context"], t["context_reason"]) for t in turns_of(gw, a["rollout_id"])]
    assert got == [
        ("rendered", "first_turn"),
        ("exact", None),
        ("rendered", "forgotten"),
        ("exact", None),
    ]


# ------------------------------------------------------------------------ tool calls round trip


@pytest.mark.parametrize("content", [None, "", "absent"])
def test_a_tool_call_sent_back_reserialized_matches_the_answer(tmp_path, content):
    engine = ScriptedEngine()
    tok = engine.tokenizer
    with live_gateway(tmp_path, engine) as gw:
        (a,) = gw.create(1)
        client = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "add"}]
        text = '<tool_call>{"name":"calc","arguments":{"b":[1,2.5,{"y":null}],"a":"x"}}</tool_call>'
        engine.script.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
        out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        (tc,) = out.choices[0].message.tool_calls
        assert json.loads(tc.function.arguments) == {"b": [1, 2.5, {"y": None}], "a": "x"}
        back = {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_renamed_by_harness",
                    "type": "function",
                    "function": {
                        "name": "calc",
                        "arguments": '{ "a" : "x" ,"b" : [1, 2.5, {"y": null}] }',
                    },
                }
            ],
        }
        if content != "absent":
            back["content"] = content
        msgs += [back, {"role": "tool", "tool_call_id": "call_renamed_by_harness", "content": "3"}]
        engine.script.append(tok.encode("done", add_special_tokens=False) + [tok.eos_token_id])
        client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        turns = turns_of(gw, a["rollout_id"])
    assert turns[1]["context"] == "exact"
    before = turns[0]["prompt_ids"] + turns[0]["response_ids"]
    assert turns[1]["prompt_ids"][: len(before)] == before


def test_an_unparsable_tool_call_stays_text_and_still_matches(tmp_path):
    engine = ScriptedEngine()
    tok = engine.tokenizer
    with live_gateway(tmp_path, engine) as gw:
        (a,) = gw.create(1)
        client = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "add"}]
        text = 'Let me see. <tool_call>{"name": "calc", "arguments": {"expr": 1+2}</tool_call>'
        engine.script.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
        out = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        message = out.choices[0].message
        assert message.tool_calls is None and message.content == text
        msgs += [
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": "that call was malformed"},
        ]
        engine.script.append(tok.encode("sorry", add_special_tokens=False) + [tok.eos_token_id])
        client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        turns = turns_of(gw, a["rollout_id"])
    assert turns[1]["context"] == "exact"


def test_earlier_reasoning_stays_under_exact_and_breaks_the_prefix_under_template(tmp_path):
    """A template that drops the <think> of earlier assistant turns: under exact the model keeps
    seeing its reasoning (one row); under template the prefix breaks there (assistant_rewrite)."""
    results = {}
    for policy in ("exact", "template"):
        engine = ScriptedEngine(with_template(tiny_tokenizer(), DROPS_OLD_REASONING))
        tok = engine.tokenizer
        (tmp_path / policy).mkdir()
        with live_gateway(tmp_path / policy, engine, context=policy) as gw:
            (a,) = gw.create(1)
            client = OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0)
            msgs = [{"role": "user", "content": "2+2?"}]
            run_turns(gw, client, msgs, ["<think>two and two</think>4", "<think>again</think>4"])
            gw.admin.patch(f"/rollouts/{a['rollout_id']}", json={"state": "succeeded"})
            rollouts = gw.store.load_rollouts(rollout_ids=[a["rollout_id"]])
        _, metrics, breaks = aggregate(rollouts, max_prompt_length=1024, max_response_length=64,
                                       pad_token_id=0, tokenizer=tok, return_breaks=True)
        results[policy] = (metrics["n_rows"], [b.kind for b in breaks], rollouts[0])
    assert results["exact"][:2] == (1, [])
    last_prompt = results["exact"][2].turns[1].prompt_ids
    assert "two and two" in tok.decode(list(last_prompt))
    assert results["template"][:2] == (2, ["assistant_rewrite"])
