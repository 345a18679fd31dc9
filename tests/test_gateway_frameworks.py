"""Agent frameworks at their default settings against a live gateway on loopback (chat
completions), with a scripted engine that calls the tool on cue: the framework runs the tool the
model called and hands the result back, every turn is recorded, and each run's second call
continues its first exactly (`context: exact`)."""

from __future__ import annotations

import json

import pytest
from gateway_fixtures import ScriptedEngine, live_gateway


def say(engine, text: str) -> None:
    tok = engine.tokenizer
    engine.script.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture
def gw(tmp_path):
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        yield gw
        gw.admin.close()


def test_langgraph_react_agent_over_langchain_openai(gw):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    seen = []

    @tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expr)
        return str(eval(expr, {}, {}))

    (r,) = gw.create(1)
    agent = create_react_agent(ChatOpenAI(model="policy", base_url=r["base_url"],
                                          api_key=r["api_key"], max_retries=0), [calc])
    say(gw.engine, call("calc", {"expr": "6*7"}))
    say(gw.engine, "It is 42.")
    out = agent.invoke({"messages": [("user", "What is 6*7?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert out["messages"][2].content == "42" and out["messages"][-1].content == "It is 42."

    say(gw.engine, call("calc", {"expr": "2+2"}))
    say(gw.engine, "It is 4.")
    chunks = list(agent.stream({"messages": [("user", "What is 2+2?")]}, stream_mode="messages"))
    text = "".join(c.content for c, meta in chunks if meta.get("langgraph_node") == "agent")
    assert "It is 4." in text
    assert seen == ["6*7", "2+2"]
    turns = gw.store.get_turns(r["rollout_id"])
    assert [(t.context, t.context_reason) for t in turns] == [
        ("rendered", "first_turn"), ("exact", None), ("rendered", "no_match"), ("exact", None)]
