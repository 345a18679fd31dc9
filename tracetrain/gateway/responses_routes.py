"""OpenAI Responses API, one base URL per rollout: POST {base}/rollouts/{rollout_id}/v1/responses.

A request is turned into the chat conversation it stands for, then takes the chat completions'
path (openai_routes.chat_answer: exact context, the chat template, generate, record, tool calls
parsed), and the answer is written back as Responses output items:

    instructions                      -> a system message first
    input: a string                   -> a user message
    input items  message              -> a message of its role (text parts joined)
                 function_call        -> a tool call of the assistant message before it (calls
                                         that follow one another, or follow an assistant
                                         message, are one assistant turn)
                 function_call_output -> a tool message (its call_id must name a call above)
                 reasoning            -> dropped (the gateway never produces one)
    previous_response_id              -> that response's conversation and output come first
                                         (kept in memory for recent responses of this rollout;
                                         `instructions` are not carried over, as in OpenAI's API)
    tools [{type: function, name, description, parameters}] -> chat tools

    output: a `message` item with `output_text` when there is text, a `function_call` item per
    parsed call (call_id = the chat tool call's id); status "incomplete" (reason
    max_output_tokens) when generation was cut.

Streaming sends the whole turn, once recorded, as the Responses events the SDK parses
(response.created ... response.completed, each with a sequence_number).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import orjson
from fastapi.responses import Response

from tracetrain.gateway import render
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.openai_routes import (
    ChatAnswer,
    _json,
    _parse,
    _rollout,
    chat_answer,
    endpoint,
    named_sse,
)
from tracetrain.gateway.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesIn,
    _Sampling,
)

KEPT_RESPONSES = 4096  # conversations kept for previous_response_id (an LRU over all rollouts)


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(body: ResponsesIn, before: list[dict]) -> list[dict]:
    """The chat messages a Responses request stands for, after `before` (the conversation of
    previous_response_id), without the instructions."""
    messages = list(before)
    items = body.input if isinstance(body.input, list) else [MessageItem(role="user", content=body.input)]
    calls: set[str] = {
        c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()
    }
    for k, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", [])
                last["tool_calls"] = [*(last["tool_calls"] or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise ApiError(
                    400,
                    f"input[{k}].call_id {item.call_id!r} names no function_call before it",
                    f"input[{k}].call_id",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
    return messages


def chat_tools(body: ResponsesIn) -> list[dict] | None:
    if not body.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                k: v
                for k, v in (
                    ("name", t.name),
                    ("description", t.description),
                    ("parameters", t.parameters),
                )
                if v is not None
            },
        }
        for t in body.tools
    ]


class KeptResponses:
    """response id -> (rollout id, its conversation and answer as chat messages), for
    previous_response_id. Bounded (LRU); lost at a restart."""

    def __init__(self, size: int = KEPT_RESPONSES):
        self.size = size
        self._kept: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    def keep(self, response_id: str, rollout_id: str, messages: list[dict]) -> None:
        self._kept[response_id] = (rollout_id, orjson.dumps(messages))
        if len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str, rollout_id: str) -> list[dict]:
        got = self._kept.get(response_id)
        if got is None or got[0] != rollout_id:
            raise ApiError(
                404,
                f"previous_response_id {response_id!r} is not a recent response of this rollout",
                "previous_response_id",
            )
        return orjson.loads(got[1])


def _kept(gw) -> KeptResponses:
    kept = getattr(gw, "kept_responses", None)
    if kept is None:
        kept = gw.kept_responses = KeptResponses()
    return kept


def output_items(answer: ChatAnswer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if answer.content:
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": answer.content, "annotations": []}],
            }
        )
    for call in answer.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_object(
    body: ResponsesIn, response_id: str, model: str, answer: ChatAnswer | None, extra: dict
) -> dict[str, Any]:
    """The Response; `answer` None: the in-progress one streaming opens with."""
    cut = answer is not None and answer.gen.finish_reason == "length" and not answer.tool_calls
    out: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress" if answer is None else ("incomplete" if cut else "completed"),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [] if answer is None else output_items(answer),
        "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": body.top_p,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": None,
    }
    if answer is not None:
        p, c = len(answer.prompt_ids), len(answer.gen.response_ids)
        out["usage"] = {
            "input_tokens": p,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + c,
        }
        out.update(extra)
    return out


def stream_events(started: dict, done: dict) -> list[dict[str, Any]]:
    """The Responses events of a whole turn: created, in_progress, each output item (added, its
    content or arguments as one delta, done), completed."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for i, item in enumerate(done["output"]):
        base = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [
                {"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **base, "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": []}},
                {"type": "response.output_text.delta", **base, "content_index": 0,
                 "delta": text, "logprobs": []},
                {"type": "response.output_text.done", **base, "content_index": 0,
                 "text": text, "logprobs": []},
                {"type": "response.content_part.done", **base, "content_index": 0,
                 "part": item["content"][0]},
            ]
        else:
            events += [
                {"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **base,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **base,
                 "name": item["name"], "arguments": item["arguments"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.completed", "response": done})
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return events


async def responses_turn(gw, rollout_id: str, authorization: str | None, raw: bytes) -> Response:
    """OpenAI Responses API: one turn of the rollout."""
    rollout = _rollout(gw, authorization, rollout_id)
    body: ResponsesIn = _parse(ResponsesIn, raw)
    slot = gw.slot_for(rollout)
    parse_calls = render.tool_choice_parses(body.tool_choice, gw.forced_tool_choice)
    text = getattr(body, "text", None)
    render.plain_text_only(text.get("format") if isinstance(text, dict) else None, "text.format")
    kept = _kept(gw)
    before = [] if body.previous_response_id is None else kept.get(body.previous_response_id, rollout_id)
    history = conversation(body, before)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    sampling = _Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    answer = await chat_answer(
        gw, rollout, slot, system + history, chat_tools(body), sampling, body.max_output_tokens,
        parse_calls,
    )
    response_id = f"resp_{uuid.uuid4().hex}"
    kept.keep(response_id, rollout_id, [*history, answer.message])
    extra: dict[str, Any] = {
        "tracetrain": {
            "rollout_id": rollout_id,
            "turn_index": answer.index,
            "model_version": answer.gen.model_version,
        }
    }
    if body.return_token_ids:
        extra["prompt_token_ids"] = answer.prompt_ids
        extra["token_ids"] = answer.gen.response_ids
    model = body.model or slot.name
    done = response_object(body, response_id, model, answer, extra)
    if not body.stream:
        return _json(done)
    return named_sse(stream_events(response_object(body, response_id, model, None, {}), done))


ROUTE = ("/rollouts/{rollout_id}/v1/responses", endpoint(responses_turn), ResponsesIn)
