"""An agent written with the OpenAI Agents SDK at its defaults (the Responses API), with two
function tools, trained as it is: the arithmetic questions of examples/environment_class, but
played by an `Agent` whose `calculate` and `submit` are `@function_tool`s over its ArithmeticEnv.

The run's rows come from `data.train` (config.yaml); each row is a task. The agent asks the
policy through the rollout's gateway URL; the run ends when it calls `submit`
(`StopAtTools`); the reward is 1 when the submitted answer is right, 0 otherwise (a reply cut at
max_tokens, which the SDK raises on, included).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)  # its default exports traces to OpenAI's servers
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)  # a cut reply: reward 0, not a log line
# the questions' environment (examples/environment_class/env.py): its methods do the tools' work
_spec = importlib.util.spec_from_file_location(
    "arithmetic_env", Path(__file__).resolve().parents[1] / "environment_class" / "env.py")
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)


async def agent(task: dict, client: dict) -> float:
    env = _env.ArithmeticEnv()
    env.reset(**task)

    @function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: integers combined with +, - and *, e.g. "12 * 7"
        """
        return env.calculate(expression)

    @function_tool
    def submit(answer: int) -> str:
        """Submit the final answer; this ends the episode.

        Args:
            answer: the answer to the question
        """
        return env.submit(answer)

    openai = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"],
                         http_client=client["http_client"])
    model = OpenAIResponsesModel(model=client["model"], openai_client=openai)
    settings = ModelSettings(temperature=client["temperature"], top_p=client["top_p"],
                             max_tokens=client["max_tokens"])
    solver = Agent(name="calculator", instructions="You are a careful assistant. Use the tools.",
                   tools=[calculate, submit], model=model, model_settings=settings,
                   tool_use_behavior=StopAtTools(stop_at_tool_names=["submit"]))
    try:
        await Runner.run(solver, task["prompt"], max_turns=4)
    except (ModelBehaviorError, MaxTurnsExceeded):  # the policy's own failure (an answer cut at
        pass  # max_tokens, no submit in 4 turns): the task failed, reward 0 (not a failed rollout)
    return float(env.submitted == env.answer)
