"""Two roles in one program, with real agent frameworks at their defaults against a live gateway on
loopback: each framework names a role the way it already names a model, the gateway records each
call's role, and the trained role's calls alone make rows. (anthropic with two `model` names:
test_gateway_roles.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, autogen_python, hermes_call, live_gateway
from openai import AsyncOpenAI

from tracetrain.rows.aggregate import aggregate


@pytest.fixture
def gw(tmp_path):
    with live_gateway(tmp_path, ScriptedEngine()) as gw:
        yield gw
        gw.admin.close()


def finished(gw, rid: str):
    gw.admin.patch(f"/rollouts/{rid}", json={"state": "succeeded", "reward": 1.0})
    (r,) = gw.store.load_rollouts(rollout_ids=[rid])
    return r


def rows_of(rollout, train_roles):
    batch, _ = aggregate([rollout], max_prompt_length=4096, max_response_length=4096,
                         train_roles=train_roles)
    return batch


def test_langgraph_two_nodes_on_two_model_names(gw):
    """A StateGraph whose solver node and checker node each hold a ChatOpenAI with its own model
    name; the checker sends the answer back once."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    (r,) = gw.create(1)

    def chat(model: str) -> ChatOpenAI:
        return ChatOpenAI(model=model, base_url=r["base_url"], api_key=r["api_key"], max_retries=0)

    solver, checker = chat("solver"), chat("checker")

    def solve(state):
        return {"messages": [solver.invoke(state["messages"])]}

    def check(state):
        verdict = checker.invoke([("system", "Reply ok or redo."), ("user", state["messages"][-1].content)])
        return {"messages": [("user", "Checker: " + verdict.content)]}

    def after_check(state):  # (no hints: langgraph evaluates them in this module)
        return END if state["messages"][-1].content.endswith("ok") else "solve"

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "check")
    graph.add_conditional_edges("check", after_check)
    app = graph.compile()
    for text in ("It is 41.", "redo", "It is 42.", "ok"):
        gw.engine.say(text)
    out = app.invoke({"messages": [("user", "What is 6*7?")]})
    assert out["messages"][-2].content == "It is 42."
    turns = gw.store.get_turns(r["rollout_id"])
    assert [t.role for t in turns] == ["solver", "checker", "solver", "checker"]
    # The solver's second call continues its first exactly, the checker's call between them
    # notwithstanding; trained alone, the solver's chain is one row.
    assert [(t.context, t.role) for t in turns][2] == ("exact", "solver")
    rollout = finished(gw, r["rollout_id"])
    batch = rows_of(rollout, ["solver"])
    assert batch.n_rows == 1 and [k for k, _, _ in batch.turn_spans[0]] == [0, 2]


def test_the_agents_sdk_hands_off_between_two_agents_with_their_own_models(gw):
    import agents

    agents.set_tracing_disabled(True)
    (r,) = gw.create(1)

    async def main():
        client = AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"], max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        specialist = agents.Agent(name="Specialist", instructions="Answer.", model="specialist")
        triage = agents.Agent(name="Triage", instructions="Hand off.", model="triage",
                              handoffs=[specialist])
        gw.engine.say(hermes_call("transfer_to_specialist", {}))
        gw.engine.say("It is 42.")
        ran = await agents.Runner.run(triage, "What is 6*7?")
        return ran.final_output, ran.last_agent.name

    final, last = asyncio.run(main())
    assert (final, last) == ("It is 42.", "Specialist")
    turns = gw.store.get_turns(r["rollout_id"])
    assert [t.role for t in turns] == ["triage", "specialist"]
    batch = rows_of(finished(gw, r["rollout_id"]), ["specialist"])
    assert batch.n_rows == 1 and [k for k, _, _ in batch.turn_spans[0]] == [1]


def test_pydantic_ai_two_agents_on_two_model_names(gw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    (r,) = gw.create(1)
    provider = OpenAIProvider(base_url=r["base_url"], api_key=r["api_key"])
    writer = Agent(OpenAIChatModel("writer", provider=provider), instructions="Write.")
    editor = Agent(OpenAIChatModel("editor", provider=provider), instructions="Edit.")
    gw.engine.say("A draft.")
    gw.engine.say("An edit.")
    draft = writer.run_sync("Write one line.").output
    edited = editor.run_sync(f"Edit: {draft}").output
    assert (draft, edited) == ("A draft.", "An edit.")
    assert [t.role for t in gw.store.get_turns(r["rollout_id"])] == ["writer", "editor"]


def test_smolagents_two_agents_on_two_model_ids(tmp_path):
    """Two ToolCallingAgents on their own model ids (a gateway that serves their forced tool
    choice as auto, as docs/agents.md says)."""
    from smolagents import OpenAIServerModel, ToolCallingAgent

    with live_gateway(tmp_path, ScriptedEngine(), forced_tool_choice="as_auto") as gw:
        gw.engine.max_context = 32768  # its system prompt lists every tool and rule
        (r,) = gw.create(1)

        def agent(model_id: str) -> ToolCallingAgent:
            model = OpenAIServerModel(model_id=model_id, api_base=r["base_url"], api_key=r["api_key"])
            return ToolCallingAgent(tools=[], model=model, verbosity_level=0)

        gw.engine.say(hermes_call("final_answer", {"answer": "a draft"}))
        gw.engine.say(hermes_call("final_answer", {"answer": "an edit"}))
        draft = agent("writer").run("Write one line.")
        edited = agent("editor").run(f"Edit: {draft}")
        assert (str(draft), str(edited)) == ("a draft", "an edit")
        assert [t.role for t in gw.store.get_turns(r["rollout_id"])] == ["writer", "editor"]
        gw.admin.close()


def test_autogen_two_assistant_agents_as_a_command_agent(gw):
    python = autogen_python()
    from tracetrain.agents.runner import GatewayClient, load_agent, run_rollouts

    gw.engine.say(hermes_call("calc", {"expr": "6*7"}))
    gw.engine.say("yes")
    script = Path(__file__).resolve().parents[1] / "support" / "autogen_roles_agent.py"
    agent = load_agent(f"{python} {script}")

    async def main():
        client = GatewayClient(gw.url, gw.admin_key)
        try:
            return await run_rollouts(client, [{"rollout_id": "ag2", "task": {"question": "6*7?"}}],
                                      agent, concurrency=1, timeout_s=120,
                                      client_extra={"model": "policy"})
        finally:
            await client.aclose()

    (result,) = asyncio.run(main())
    assert (result.state, result.reward) == ("succeeded", 1.0), result.error
    turns = gw.store.get_turns("ag2")
    assert [(t.role, t.reward) for t in turns] == [("solver", 0.5), ("checker", None)]
