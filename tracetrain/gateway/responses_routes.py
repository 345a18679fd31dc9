"""OpenAI Responses API, one base URL per rollout: POST {base}/rollouts/{rollout_id}/v1/responses.

A request is turned into the chat conversation it stands for, then takes the chat completions'
path (turn.chat_answer: exact context, the chat template, generate, record, tool calls
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

Streaming (streaming.py) sends the Responses events the SDK parses, each with a sequence_number:
response.created and response.in_progress at once; the message item's output_text deltas as the
engine makes the text; once the turn is recorded, the rest of the text, each function_call item
(its arguments as one delta) and response.completed.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import Response

from tracetrain.gateway import errors
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.jsonbytes import dumps
from tracetrain.gateway.schemas.openai import _Sampling
from tracetrain.gateway.schemas.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesIn,
)
from tracetrain.gateway.streaming import EventStream, LiveTurn, TextDeltas
from tracetrain.gateway.turn import (
    ChatAnswer,
    begin_turn,
    chat_answer,
    decoding_for,
    endpoint,
    json_response,
    turn_meta,
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
        self._kept[response_id] = (rollout_id, dumps(messages))
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


def output_items(answer: ChatAnswer, message_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if answer.content:
        items.append(
            {
                "type": "message",
                "id": message_id,
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


def text_format(body: ResponsesIn) -> Any:
    """The request's text.format (None if absent)."""
    text = getattr(body, "text", None)
    return text.get("format") if isinstance(text, dict) else None


def response_object(
    body: ResponsesIn, ids: tuple[str, str], model: str, answer: ChatAnswer | None, extra: dict
) -> dict[str, Any]:
    """The Response; `ids`: its id and its message item's; `answer` None: the in-progress one
    streaming opens with."""
    response_id, message_id = ids
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
        "output": [] if answer is None else output_items(answer, message_id),
        "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": body.top_p,
        "text": {"format": text_format(body) or {"type": "text"}},
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


async def live_events(
    live: LiveTurn, started: dict, done: Callable[[ChatAnswer], dict], message_id: str
) -> AsyncIterator[bytes]:
    """The Responses events of a live turn (module docstring); `done(answer)`: the Response."""
    numbers = itertools.count()

    def event(e: dict[str, Any]) -> bytes:
        e["sequence_number"] = next(numbers)
        return b"event: %s\ndata: %s\n\n" % (e["type"].encode(), dumps(e))

    part = {"item_id": message_id, "output_index": 0, "content_index": 0}

    def opening() -> list[bytes]:
        item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant",
                "content": []}
        return [event({"type": "response.output_item.added", "output_index": 0, "item": item}),
                event({"type": "response.content_part.added", **part,
                       "part": {"type": "output_text", "text": "", "annotations": []}})]

    def delta(text: str) -> bytes:
        return event({"type": "response.output_text.delta", **part, "delta": text, "logprobs": []})

    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    opened = False
    try:
        async for text in live.text():
            if not opened:
                opened = True
                for e in opening():
                    yield e
            yield delta(text)
        answer: ChatAnswer = live.task.result()
    except Exception as exc:
        error = (await errors.body(exc))["error"]
        yield event({"type": "error", "code": str(error["code"]), "message": error["message"],
                     "param": error["param"]})
        return
    response = done(answer)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            if not opened:
                for e in opening():
                    yield e
            rest = live.deltas.rest(answer.content)
            if rest:
                yield delta(rest)
            text = item["content"][0]["text"]
            yield event({"type": "response.output_text.done", **part, "text": text, "logprobs": []})
            yield event({"type": "response.content_part.done", **part, "part": item["content"][0]})
        else:
            base = {"item_id": item["id"], "output_index": i}
            yield event({"type": "response.output_item.added", "output_index": i,
                         "item": {**item, "status": "in_progress", "arguments": ""}})
            yield event({"type": "response.function_call_arguments.delta", **base,
                         "delta": item["arguments"]})
            yield event({"type": "response.function_call_arguments.done", **base,
                         "name": item["name"], "arguments": item["arguments"]})
        yield event({"type": "response.output_item.done", "output_index": i, "item": item})
    yield event({"type": "response.completed", "response": response})


async def responses_turn(gw, rollout_id: str, authorization: str | None, raw: bytes,
                         role: str | None = None) -> Response:
    """OpenAI Responses API: one turn of the rollout."""
    t = begin_turn(gw, rollout_id, authorization, raw, role, ResponsesIn)
    rollout, body, role, slot = t.rollout, t.body, t.role, t.slot
    tools = chat_tools(body)
    how = decoding_for(gw, slot, tools, body.tool_choice, text_format(body), "text.format")
    kept = _kept(gw)
    before = [] if body.previous_response_id is None else kept.get(body.previous_response_id, rollout_id)
    history = conversation(body, before)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    sampling = _Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    ids = (f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}")
    model = body.model or slot.name

    async def answer(deltas: TextDeltas | None = None) -> ChatAnswer:
        a = await chat_answer(
            gw, rollout, slot, system + history, tools, sampling, body.max_output_tokens, how,
            deltas, role,
        )
        kept.keep(ids[0], rollout_id, [*history, a.message])
        return a

    def done(a: ChatAnswer) -> dict[str, Any]:
        extra: dict[str, Any] = {"tracetrain": turn_meta(rollout_id, a.index, a.gen)}
        if body.return_token_ids:
            extra["prompt_token_ids"] = a.prompt_ids
            extra["token_ids"] = a.gen.response_ids
        return response_object(body, ids, model, a, extra)

    if not body.stream:
        return json_response(done(await answer()))
    live = LiveTurn(answer)
    await live.opened()
    started = response_object(body, ids, model, None, {})
    return EventStream(live_events(live, started, done, ids[1]), live.cancel)


ROUTE = ("/rollouts/{rollout_id}/v1/responses", endpoint(responses_turn), ResponsesIn)
