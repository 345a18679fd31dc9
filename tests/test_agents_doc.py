"""Every worked agent in docs/agents.md runs, as written, through the runner and a live gateway
whose scripted model calls the `calc` tool and then answers: each must run the tool and return
reward 1, and its rollout must be recorded turn by turn. So the docs cannot rot."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path

import pytest
from gateway_fixtures import ScriptedEngine, live_gateway

from tracetrain.agents.runner import GatewayClient, run_rollouts

DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"
BLOCK = re.compile(r"^### (.+?)\n.*?```python\n(.*?)```", re.DOTALL | re.MULTILINE)
EXAMPLES = dict(BLOCK.findall(DOC.read_text()))
TASK = {"question": "What is 6*7?", "answer": 42}


def test_the_doc_has_an_agent_per_api_and_framework():
    names = " ".join(EXAMPLES)
    for needed in ("chat completions", "Responses API", "Agents SDK", "Messages API", "LangGraph",
                   "pydantic-ai", "smolagents"):
        assert needed in names, f"docs/agents.md has no worked agent for {needed}"


@pytest.mark.parametrize("title", list(EXAMPLES))
def test_each_worked_agent_runs_and_scores(tmp_path, title):
    # As a user would: the block saved as a task module's file, then imported from it.
    path = tmp_path / "worked_agent.py"
    path.write_text(EXAMPLES[title])
    spec = importlib.util.spec_from_file_location(f"worked_agent_{abs(hash(title))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    engine = ScriptedEngine()
    engine.max_context = 32768  # smolagents' system prompt is long
    tok = engine.tokenizer
    call = "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": "6*7"}}) + "</tool_call>"
    final = ("<tool_call>" + json.dumps({"name": "final_answer", "arguments": {"answer": "42"}})
             + "</tool_call>") if "smolagents" in title else "The answer is 42."
    for text in (call, final):
        engine.script.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])

    # smolagents asks for tool_choice "required": served as auto (docs/agents.md says so)
    extra = {"forced_tool_choice": "as_auto"} if "smolagents" in title else {}
    with live_gateway(tmp_path, engine, **extra) as gw:

        async def main():
            client = GatewayClient(gw.url, gw.admin_key)
            try:
                return await run_rollouts(client, [{"rollout_id": "r", "task": TASK}],
                                          module.agent, concurrency=1, timeout_s=60,
                                          client_extra={"model": "policy"})
            finally:
                await client.aclose()

        (result,) = asyncio.run(main())
        turns = gw.store.get_turns("r")
    assert (result.state, result.reward) == ("succeeded", 1.0), result.error
    assert len(turns) == 2 and engine.script == type(engine.script)()  # both answers were asked for
    assert [t.response_ids for t in turns] == [g.response_ids for _, g in engine.calls]
    roles = re.search(r"^# roles: (.+)$", EXAMPLES[title], re.MULTILINE)
    if roles:  # a block of "Several roles": each call's role as the block says, a turn reward
        assert [t.role for t in turns] == [x.strip() for x in roles[1].split(",")]
        gives = "turn_rewards" in EXAMPLES[title] or "/turn-rewards" in EXAMPLES[title]
        assert [t.reward for t in turns] == ([0.1, None] if gives else [None, None])
    else:
        assert {t.role for t in turns} == {"policy"}  # client["model"]
