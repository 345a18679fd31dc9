"""An expert behind the gateway: answers chat requests with another policy's replies, in the
policy's own tokens.

    reply = await expert(messages, tools)          a scripted function, or a model behind a URL
    ids   = tool_prompt.reply_ids(policy tokenizer, messages, tools, reply)

so a rollout the expert plays is recorded as if the policy had written the expert's replies: the
prompt ids are the gateway's, for the policy's template (tool block included where it writes one),
and the response ids are what that template writes for the reply, cut at the turn's end. The
gateway reads the calls back out of those ids with its own parser, so the agent sees the expert's
calls exactly as it would see the policy's. Logprobs are 0 (the expert's are not the policy's);
such turns are trained on by the supervised warm start only, never by RL (run/expert.py).

An expert is `async (messages, tools) -> reply`, the reply a chat assistant message
({"content": str | None, "tool_calls": [...]}) or a str (its content). `chat_expert(url, model,
...)` makes one of an OpenAI-compatible chat completions endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from tracetrain.engines.base import EngineError, Generation, OnTokens, SamplingParams
from tracetrain.models.tool_prompt import reply_ids

Expert = Callable[[list[dict], list | None], Awaitable[dict | str]]
EXPERT_VERSION = None  # the model_version its turns are recorded with: no version of the policy


class ExpertEngine:
    """An Engine whose answers are `expert`'s replies, tokenized for `tokenizer` (the policy's).
    `inject`: the gateway writes the tool block for this tokenizer (tool_prompt.writes_block)."""

    name = "expert"
    answers_chat = True  # the gateway hands it the conversation (SamplingParams.conversation)

    def __init__(self, tokenizer: Any, expert: Expert, *, max_context: int, inject: bool):
        self.tokenizer, self.expert, self.inject = tokenizer, expert, inject
        self.max_context = max_context
        self.model_version = 0  # (the gateway's description of it; its turns carry EXPERT_VERSION)
        self.stats: dict[str, float] = {"replies": 0}

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: OnTokens | None = None
    ) -> Generation:
        if params.conversation is None:
            raise EngineError("the expert answers chat requests only (messages, not prompt ids)",
                              status=400)
        messages, tools = params.conversation
        reply = await self.expert(messages, tools)
        if isinstance(reply, str):
            reply = {"role": "assistant", "content": reply}
        if not isinstance(reply, dict):
            raise EngineError(f"the expert replied a {type(reply).__name__}, not a message or a "
                              "str", status=502)
        reply = {"role": "assistant", **reply}
        try:
            ids = reply_ids(self.tokenizer, messages, tools, reply, inject=self.inject,
                            stop_ids=params.stop_token_ids)
        except ValueError as e:
            raise EngineError(f"the expert's reply has no tokens of its own: {e}", status=502) from e
        if len(ids) > params.max_tokens:  # a cut reply would teach the policy a broken one
            raise EngineError(f"the expert's reply is {len(ids)} tokens, more than the request's "
                              f"max_tokens {params.max_tokens} (a run's rollout.max_tokens)",
                              status=502)
        self.stats["replies"] += 1
        if on_tokens is not None:
            on_tokens(list(ids))
        return Generation(ids, [0.0] * len(ids), "stop", EXPERT_VERSION)

    async def aclose(self) -> None:
        return None


def chat_expert(url: str, model: str, *, api_key_env: str | None = None, temperature: float = 0.0,
                max_tokens: int = 512, timeout_s: float = 120.0) -> Expert:
    """An expert that is a model behind an OpenAI-compatible chat completions endpoint (`url`: its
    base, e.g. http://127.0.0.1:8000/v1); the key, when it needs one, from $`api_key_env`."""
    import httpx

    headers = {}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise EngineError(f"the expert's key: ${api_key_env} is not set", status=500)
        headers["Authorization"] = f"Bearer {key}"
    endpoint = url.rstrip("/") + "/chat/completions"

    async def expert(messages: list[dict], tools: list | None) -> dict:
        body = {"model": model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, **({"tools": tools} if tools else {})}
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            r = await http.post(endpoint, json=body, headers=headers)
        if r.status_code != 200:
            raise EngineError(f"the expert at {endpoint} answered {r.status_code}: {r.text[:300]}",
                              status=502)
        message = r.json()["choices"][0]["message"]
        return {"content": message.get("content"), "tool_calls": message.get("tool_calls") or []}

    return expert
