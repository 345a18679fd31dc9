"""Anthropic Messages API, one base URL per rollout: POST {base}/rollouts/{rollout_id}/v1/messages.

The request is turned into the chat conversation it stands for and takes the chat completions'
path (turn.chat_answer: exact context, the chat template, generate, record, tool calls
parsed); the answer is written back as content blocks:

    system (a string or text blocks)   -> a system message first
    user message     text blocks        -> a user message (after its tool results, if any)
                     tool_result blocks -> a tool message each (tool_use_id must name a tool_use
                                           before it)
    assistant        text blocks        -> the assistant message's content
                     tool_use blocks    -> its tool calls (input as JSON arguments)
                     thinking blocks    -> dropped (the gateway never produces them)
    tools [{name, description, input_schema}] -> chat function tools
    stop_sequences                      -> stop tokens (one-token sequences) and stop strings

    content: a text block when there is text, a tool_use block per parsed call; stop_reason
    tool_use | end_turn | stop_sequence | max_tokens.

The key may come as `x-api-key` (what the anthropic SDK sends) or `Authorization: Bearer`.
Errors are Anthropic's shape, {"type": "error", "error": {"type", "message"}}, the message naming
the field at fault. Streaming (streaming.py) sends Anthropic's events: message_start, the text
block's text_delta events as the engine makes the text; once the turn is recorded, the rest of
the text, each tool_use block (its input as one input_json_delta), message_delta (stop_reason,
output tokens) and message_stop.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tracetrain.gateway import errors, render
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.jsonbytes import dumps
from tracetrain.gateway.schemas.anthropic import (
    MessagesIn,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tracetrain.gateway.schemas.openai import _Sampling
from tracetrain.gateway.streaming import EventStream, LiveTurn, TextDeltas
from tracetrain.gateway.turn import (
    ChatAnswer,
    begin_turn,
    chat_answer,
    decoding_for,
    json_response,
    turn_meta,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _text(content: str | list | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _json_text(value: Any) -> str:
    return dumps(value).decode()


def conversation(body: MessagesIn) -> list[dict]:
    """The chat messages an Anthropic request stands for."""
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    uses: set[str] = set()
    for k, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": _json_text(b.input)},
                }
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            uses.update(c["id"] for c in calls)
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            continue
        for j, b in enumerate(blocks):
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in uses:
                    field = f"messages[{k}].content[{j}].tool_use_id"
                    raise ApiError(
                        400, f"{field} {b.tool_use_id!r} names no tool_use before it", field
                    )
                messages.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                )
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": "user", "content": text})
    return messages


def chat_tools(body: MessagesIn) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for t in body.tools:
        function = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            function["description"] = t.description
        out.append({"type": "function", "function": function})
    return out


def content_blocks(answer: ChatAnswer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        try:
            args = orjson.loads(call["function"]["arguments"])
        except orjson.JSONDecodeError:
            args = None
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": args if isinstance(args, dict) else {"arguments": args},
            }
        )
    return blocks


def stop_reason(answer: ChatAnswer, stops: dict[int, str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); `stops`: the stop sequences that are one token, by id."""
    if answer.tool_calls:
        return "tool_use", None
    if answer.gen.finish_reason == "length":
        return "max_tokens", None
    if answer.stop_string is not None:
        return "stop_sequence", answer.stop_string
    last = answer.gen.response_ids[-1] if answer.gen.response_ids else None
    if last in stops:
        return "stop_sequence", stops[last]
    return "end_turn", None


def anthropic_error(response: Response) -> Response:
    """An error answer (OpenAI's shape, errors.py) in Anthropic's shape; the message names the
    field at fault."""
    try:
        error = orjson.loads(response.body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response
    message = error.get("message") or ""
    param = error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    status = response.status_code
    kind = _ERROR_TYPES.get(status, "api_error")
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}},
        status_code=status,
        headers=headers,
    )


async def live_events(
    live: LiveTurn, head: dict[str, Any], done: Callable[[ChatAnswer], dict]
) -> AsyncIterator[bytes]:
    """Anthropic's events of a live turn (module docstring); `head`: the message's fixed fields;
    `done(answer)`: the whole message."""

    def event(e: dict[str, Any]) -> bytes:
        return b"event: %s\ndata: %s\n\n" % (e["type"].encode(), dumps(e))

    def text_delta(text: str) -> bytes:
        return event({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "text_delta", "text": text}})

    opening = event({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}})
    yield event({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": live.deltas.prompt_tokens, "output_tokens": 0}}})
    opened = False
    try:
        async for text in live.text():
            if not opened:
                opened = True
                yield opening
            yield text_delta(text)
        answer: ChatAnswer = live.task.result()
    except Exception as exc:
        error = anthropic_error(await errors.handle(None, exc))
        yield event(orjson.loads(error.body))
        return
    message = done(answer)
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            if not opened:
                yield opening
            rest = live.deltas.rest(answer.content)
            if rest:
                yield text_delta(rest)
        else:
            yield event({"type": "content_block_start", "index": i,
                         "content_block": {**block, "input": {}}})
            yield event({"type": "content_block_delta", "index": i,
                         "delta": {"type": "input_json_delta",
                                   "partial_json": _json_text(block["input"])}})
        yield event({"type": "content_block_stop", "index": i})
    yield event({"type": "message_delta",
                 "delta": {"stop_reason": message["stop_reason"],
                           "stop_sequence": message["stop_sequence"]},
                 "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    yield event({"type": "message_stop"})


async def messages_turn(gw, rollout_id: str, authorization: str | None, raw: bytes,
                        role: str | None = None) -> Response:
    """Anthropic Messages: one turn of the rollout."""
    t = begin_turn(gw, rollout_id, authorization, raw, role, MessagesIn)
    rollout, body, role, slot = t.rollout, t.body, t.role, t.slot
    tok = slot.engine.tokenizer
    tools = chat_tools(body)
    how = decoding_for(gw, slot, tools, body.tool_choice)
    try:
        stop_ids, _ = render.stops(tok, body.stop_sequences)
    except ApiError as e:
        raise ApiError(e.status_code, str(e.detail).replace("stop", "stop_sequences", 1),
                       "stop_sequences") from None
    one_token = [s for s in body.stop_sequences or () if len(tok.encode(s, add_special_tokens=False)) == 1]
    stops = dict(zip(stop_ids, one_token, strict=True))
    sampling = _Sampling(temperature=body.temperature, top_p=body.top_p, stop=body.stop_sequences)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": body.model or slot.name}

    def answer(deltas: TextDeltas | None = None):
        return chat_answer(
            gw, rollout, slot, conversation(body), tools, sampling, body.max_tokens, how, deltas,
            role,
        )

    def done(a: ChatAnswer) -> dict[str, Any]:
        reason, sequence = stop_reason(a, stops)
        message: dict[str, Any] = {
            **head,
            "content": content_blocks(a),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(a.prompt_ids), "output_tokens": len(a.gen.response_ids)},
            "tracetrain": turn_meta(rollout_id, a.index, a.gen),
        }
        if body.return_token_ids:
            message["prompt_token_ids"] = a.prompt_ids
            message["token_ids"] = a.gen.response_ids
        return message

    if not body.stream:
        return json_response(done(await answer()))
    live = LiveTurn(answer)
    await live.opened()
    return EventStream(live_events(live, head, done), live.cancel)


def authorization_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key as `Authorization: Bearer`, from that header or from `x-api-key`."""
    if authorization is None and x_api_key is not None:
        return f"Bearer {x_api_key}"
    return authorization


async def messages(request: Request) -> Response:
    """Anthropic Messages: one turn of the rollout."""
    try:
        return await messages_turn(
            request.app.state.gateway,
            request.path_params["rollout_id"],
            authorization_of(request.headers.get("authorization"), request.headers.get("x-api-key")),
            await request.body(),
            request.path_params.get("role"),
        )
    except Exception as exc:
        return anthropic_error(await errors.handle(request, exc))


ROUTE = ("/rollouts/{rollout_id}/v1/messages", messages, MessagesIn)
