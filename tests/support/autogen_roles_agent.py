"""A command agent of two AutoGen AssistantAgents at their defaults, each on its own model name (run
by tests/gateway/test_gateway_frameworks_roles.py with .venv-autogen's python): the solver answers with a
`calc` tool call, the checker reviews the result; the solver's turn gets a turn reward as it is
made and the rollout its reward, both posted to the gateway."""

import asyncio
import json
import os
import urllib.request

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

results = []
INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
        "structured_output": False}


async def calc(expr: str) -> str:
    """Evaluate an arithmetic expression."""
    results.append(str(eval(expr, {}, {})))
    return results[-1]


def post(path: str, body: dict) -> None:
    request = urllib.request.Request(
        os.environ["TRACETRAIN_ROLLOUT_URL"] + path, data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    urllib.request.urlopen(request).close()  # raises on a non-2xx answer


def client(role: str) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model=role, base_url=os.environ["OPENAI_BASE_URL"],
                                      api_key=os.environ["OPENAI_API_KEY"], model_info=INFO)


async def main() -> None:
    task = json.loads(os.environ["TRACETRAIN_TASK"])
    solver = AssistantAgent("solver", model_client=client("solver"), tools=[calc])
    checker = AssistantAgent("checker", model_client=client("checker"))
    await solver.run(task=task["question"])
    post("/turn-rewards", {"reward": 0.5, "name": "tool_ran"})  # the latest turn: the solver's
    review = await checker.run(task=f"Is {results[-1]} right?")
    post("/rewards", {"reward": float(review.messages[-1].content.strip() == "yes")})


asyncio.run(main())
