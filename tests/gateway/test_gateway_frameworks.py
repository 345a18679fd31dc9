"""Agent frameworks at their default settings against a live gateway on loopback (chat
completions), with a scripted engine that calls the tool on cue: the framework runs the tool the
model called and hands the result back, every turn is recorded, and each run's second call
continues its first exactly (`context: exact`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, autogen_python, hermes_call, live_gateway


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
    gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
    gw.engine.say("It is 42.")
    out = agent.invoke({"messages": [("user", "What is 6*7?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert out["messages"][2].content == "42" and out["messages"][-1].content == "It is 42."

    gw.engine.say(hermes_call("calc", {"expr": "2+2"}))
    gw.engine.say("It is 4.")
    chunks = list(agent.stream({"messages": [("user", "What is 2+2?")]}, stream_mode="messages"))
    text = "".join(c.content for c, meta in chunks if meta.get("langgraph_node") == "agent")
    assert "It is 4." in text
    assert seen == ["6*7", "2+2"]
    turns = gw.store.get_turns(r["rollout_id"])
    assert [(t.context, t.context_reason) for t in turns] == [
        ("rendered", "first_turn"), ("exact", None), ("rendered", "no_match"), ("exact", None)]


def test_smolagents_tool_calling_agent(tmp_path):
    """smolagents' ToolCallingAgent at its defaults: it asks for tool_choice "required" (which
    no engine here enforces: a gateway run with forced_tool_choice as_auto serves it; the default
    refuses it, saying so), it sends stop strings ("Observation:", ...), and it writes its history
    its own way (the model's tool call becomes the text "Calling tools: [...]", the result a user
    message "Observation: ..."), so its later calls match no earlier turn: rendered in full, the
    prefix break classified as the assistant turn rewritten."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.utils import AgentGenerationError

    from tracetrain.rows.aggregate import aggregate

    seen = []

    @tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expr: the expression
        """
        seen.append(expr)
        return str(eval(expr, {}, {}))

    def agent_on(gw):
        gw.engine.max_context = 32768  # its system prompt lists every tool and rule
        (r,) = gw.create(1)
        model = OpenAIServerModel(model_id="policy", api_base=r["base_url"], api_key=r["api_key"])
        return r, ToolCallingAgent(tools=[calc], model=model, verbosity_level=0)

    (tmp_path / "refuse").mkdir()
    (tmp_path / "as_auto").mkdir()
    with live_gateway(tmp_path / "refuse", ScriptedEngine()) as gw:
        _, agent = agent_on(gw)
        with pytest.raises(AgentGenerationError, match="forces a tool call"):
            agent.run("What is 6*7?", max_steps=1)
    gw = live_gateway(tmp_path / "as_auto", ScriptedEngine(), forced_tool_choice="as_auto")
    with gw as gw:
        r, agent = agent_on(gw)
        gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
        gw.engine.say(hermes_call("final_answer", {"answer": "42"}))
        assert str(agent.run("What is 6*7?")) == "42" and seen == ["6*7"]
        turns = gw.store.get_turns(r["rollout_id"])
        gw.admin.patch(f"/rollouts/{r['rollout_id']}", json={"state": "succeeded"})
        rollouts = gw.store.load_rollouts(rollout_ids=[r["rollout_id"]])
    assert [(t.context, t.context_reason) for t in turns] == [("rendered", "first_turn"),
                                                             ("rendered", "no_match")]
    _, metrics, breaks = aggregate(rollouts, max_prompt_length=32768, max_response_length=4096,
                                   pad_token_id=0, tokenizer=gw.engine.tokenizer,
                                   return_breaks=True)
    assert metrics["n_rows"] == 2 and [b.kind for b in breaks] == ["assistant_rewrite"]


def test_autogen_assistant_agent_as_a_command_agent(gw):
    """AutoGen's AssistantAgent at its defaults, in its own venv (scripts/install-autogen.sh: its
    protobuf pin conflicts with Ray's), run by the runner as a command agent: the framework runs
    the tool the model called, the agent posts its reward, and its second question continues the
    first's ids exactly."""
    python = autogen_python()
    from tracetrain.agents.runner import GatewayClient, load_agent, run_rollouts

    gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
    gw.engine.say(hermes_call("calc", {"expr": "2+2"}))
    task = {"questions": ["What is 6*7?", "And 2+2?"], "answers": ["42", "4"]}
    agent = load_agent(f"{python} {Path(__file__).resolve().parents[1] / 'support' / 'autogen_agent.py'}")

    async def main():
        client = GatewayClient(gw.url, gw.admin_key)
        try:
            return await run_rollouts(client, [{"rollout_id": "ag", "task": task}], agent,
                                      concurrency=1, timeout_s=120, client_extra={"model": "policy"})
        finally:
            await client.aclose()

    (result,) = asyncio.run(main())
    assert (result.state, result.reward) == ("succeeded", 1.0), result.error
    turns = gw.store.get_turns("ag")
    assert [(t.context, t.context_reason) for t in turns] == [("rendered", "first_turn"),
                                                             ("exact", None)]


def test_pydantic_ai_agent_over_its_openai_chat_model(gw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    (r,) = gw.create(1)
    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=r["base_url"],
                                                              api_key=r["api_key"]))
    agent = Agent(model, instructions="Use calc.")
    seen = []

    @agent.tool_plain
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expr)
        return str(eval(expr, {}, {}))

    gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
    gw.engine.say("It is 42.")
    assert agent.run_sync("What is 6*7?").output == "It is 42." and seen == ["6*7"]
    turns = gw.store.get_turns(r["rollout_id"])
    assert [(t.context, t.context_reason) for t in turns] == [("rendered", "first_turn"),
                                                             ("exact", None)]
