"""A command agent on AutoGen's AssistantAgent at its defaults (run by
tests/gateway/test_gateway_frameworks.py with .venv-autogen's python): two questions in one
conversation, each answered by a `calc` tool call; the reward (1 when both tool results are right)
is posted to the gateway."""

import asyncio
import json
import os
import urllib.request

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

results = []


async def calc(expr: str) -> str:
    """Evaluate an arithmetic expression."""
    results.append(str(eval(expr, {}, {})))
    return results[-1]


async def main() -> None:
    task = json.loads(os.environ["TRACETRAIN_TASK"])
    model = OpenAIChatCompletionClient(
        model=os.environ["TRACETRAIN_MODEL"],
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        model_info={"vision": False, "function_calling": True, "json_output": False,
                    "family": "unknown", "structured_output": False},
    )
    agent = AssistantAgent("calculator", model_client=model, tools=[calc])
    for question in task["questions"]:
        await agent.run(task=question)
    reward = float(results == task["answers"])
    request = urllib.request.Request(
        os.environ["TRACETRAIN_ROLLOUT_URL"] + "/rewards",
        data=json.dumps({"reward": reward}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"},
    )
    urllib.request.urlopen(request).close()  # raises on a non-2xx answer


asyncio.run(main())
