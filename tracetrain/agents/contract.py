"""The agent contract: what an agent gets for one rollout and what it may return.

    async def agent(task: dict, client: AgentClient) -> float | None | AgentReturn

An agent is a coroutine function (or a command run as a subprocess: runner.CommandAgent, which
gets the same values as OPENAI_BASE_URL / OPENAI_API_KEY / TRACETRAIN_* variables and reports its
reward with POST $TRACETRAIN_ROLLOUT_URL/rewards). It plays `task` through the gateway at
`client["base_url"]` with `client["api_key"]`; every model call it makes there is a recorded turn.
It passes the run's sampling settings on to its calls. An agent of several roles names each
role as its calls' `model`, or calls that role's base URL, `{rollout_url}/roles/{role}/v1`.

What becomes of the rollout (runner.call_agent):
    returns a finite float or None      succeeded (None: a reward given through the gateway, or none)
    returns an AgentReturn              succeeded; its turn rewards are given, its metrics
                                        posted as the rollout's `metrics` event, first
    raises                              failed, with the traceback kept
    runs past rollout.timeout_s         timed_out (a command: its process group killed)
A failed or timed-out rollout never gets reward 0. A coroutine agent must await its I/O: one that
blocks the event loop cannot be interrupted in-process; run such an agent as a command.
"""

from __future__ import annotations

from typing import Any, Protocol, TypedDict


class AgentClient(TypedDict, total=False):
    """What an agent gets to reach the policy for one rollout."""

    base_url: str  # the rollout's OpenAI-compatible base URL on the gateway (…/rollouts/<id>/v1)
    api_key: str  # the rollout's own key
    model: str  # the name to send as `model` (a role's name selects that role)
    rollout_id: str
    rollout_url: str  # base_url without /v1: rewards, turn-rewards, events, roles/<role>/v1
    temperature: float  # rollout.temperature (0 in eval passes)
    top_p: float  # rollout.top_p
    max_tokens: int  # rollout.max_tokens, per model call
    seed: int  # when the caller gives one: distinct per rollout (runner.rollout_seed)
    http_client: Any  # an httpx.AsyncClient shared by the call's agents: pass it to
    # AsyncOpenAI(http_client=...) and never close it


class AgentReturn(TypedDict, total=False):
    """A reward with rewards along the way: turn index -> reward (or a list of {turn, reward,
    name}); the gateway checks the turns exist and the numbers are finite. `metrics`: numbers by
    name, the rollout's `metrics` event (the step's env/<name>; `tool_errors`, types.TOOL_ERRORS:
    the calls its harness answered with an error, also the step's tools/errors)."""

    reward: float | None
    turn_rewards: dict[int, float] | list[dict]
    metrics: dict[str, float]


class Agent(Protocol):
    """One rollout of a task (the module docstring says what each outcome makes of it)."""

    async def __call__(self, task: dict, client: AgentClient) -> float | None | AgentReturn: ...
