"""OpenAI-compatible model routes, one base URL per rollout: {base}/rollouts/{rollout_id}/v1.

One request is one turn:
    prompt ids (context.py: the earlier turn's ids + the new messages, or the chat template's full
    render) -> check the rollout is open (queued -> running)
    -> engine.generate (through the engine's pause gate) -> record the turn (committed)
    -> answer (JSON, or SSE chunks then [DONE]).
The turn is in the store before the answer is sent, or, streaming (streaming.py), before its last
event: the text goes out as the engine makes it. The answer text is decoded from the response ids.
Extra fields: "tracetrain" {rollout_id, turn_index, model_version} always; "prompt_token_ids" and
choices[0].token_ids when the request sets return_token_ids.

These two routes are the hot path: `chat_turn` and `completion_turn` take the gateway, the path's
rollout id, the Authorization header and the raw body, and return the answer; fast_routes.py calls them
straight from ASGI, before FastAPI's middleware stack and router, which cost more than the rest of
a call. `install` also registers them as FastAPI routes, with the body schema, so the OpenAPI
document describes them (and an app mounted under a prefix still serves them, the slower way).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.responses import Response
from pydantic import BaseModel

from tracetrain.engines.base import (
    Generation,
    SamplingParams,
)
from tracetrain.gateway import errors, keys, render
from tracetrain.gateway.jsonbytes import dumps
from tracetrain.gateway.keys import rollout_access
from tracetrain.gateway.schemas.base import ID_PATTERN
from tracetrain.gateway.schemas.openai import ChatCompletionIn, CompletionIn
from tracetrain.gateway.slots import EngineSlot
from tracetrain.gateway.streaming import EventStream, LiveTurn, TextDeltas
from tracetrain.gateway.turn import (
    ChatAnswer,
    begin_turn,
    chat_answer,
    decoding_for,
    endpoint,
    final_text,
    generate_turn,
    json_response,
    role_of,
    turn_meta,
)
from tracetrain.store import RolloutHead
from tracetrain.types import ROLE_PATTERN

router = APIRouter(tags=["openai"])


def _usage(prompt_ids: list[int], gen: Generation) -> dict[str, int]:
    p, c = len(prompt_ids), len(gen.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: %s\n\n" % dumps(chunk)


def _token_logprobs(tokenizer: Any, gen: Generation) -> list[dict[str, Any]]:
    return [
        {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(gen.response_ids, gen.response_logprobs, strict=True)
    ]


async def chat_turn(gw, rollout_id: str, authorization: str | None, raw: bytes,
                    role: str | None = None) -> Response:
    """OpenAI chat completion: one turn of the rollout."""
    t = begin_turn(gw, rollout_id, authorization, raw, role, ChatCompletionIn, with_data=True)
    rollout, body, data, role, slot = t.rollout, t.body, t.data, t.role, t.slot
    max_tokens = render.chat_max_tokens(body)
    messages, tools = render.chat_messages(body, data)
    how = decoding_for(gw, slot, tools, body.tool_choice, getattr(body, "response_format", None))

    def answer(deltas: TextDeltas | None = None):
        return chat_answer(gw, rollout, slot, messages, tools, body, max_tokens, how, deltas, role)

    chunk = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.model or slot.name,
    }
    if not body.stream:
        return json_response(_chat_completion(chunk, body, slot, rollout_id, await answer()))
    live = LiveTurn(answer)
    await live.opened()
    chunk["object"] = "chat.completion.chunk"
    return EventStream(_chat_chunks(live, chunk, body, slot, rollout_id), live.cancel)


def _chat_completion(
    base: dict, body: ChatCompletionIn, slot: EngineSlot, rollout_id: str, a: ChatAnswer
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": a.content}
    if a.tool_calls:
        message["tool_calls"] = a.tool_calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": _token_logprobs(slot.engine.tokenizer, a.gen)} if body.logprobs else None,
        "finish_reason": a.finish,
        **_ids(body, a.gen),
    }
    return {
        **base,
        "object": "chat.completion",
        "choices": [choice],
        "usage": _usage(a.prompt_ids, a.gen),
        **_extra(body, rollout_id, a.prompt_ids, a.gen, a.index),
    }


async def _chat_chunks(
    live: LiveTurn, chunk: dict, body: ChatCompletionIn, slot: EngineSlot, rollout_id: str
) -> AsyncIterator[bytes]:
    """The chat completion chunks of a live turn: the role, the text as it comes, then (once
    recorded) the rest of the content, the tool calls, the finish reason, the usage."""

    def event(delta: dict, finish: str | None = None, **more: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _event({**chunk, "choices": [{**choice, **more.pop("choice", {})}], **more})

    yield event({"role": "assistant", "content": ""})
    try:
        async for text in live.text():
            yield event({"content": text})
        a: ChatAnswer = live.task.result()
    except Exception as exc:
        yield _event(await errors.body(exc))
        yield b"data: [DONE]\n\n"
        return
    rest = live.deltas.rest(a.content)
    if rest or body.logprobs:
        logprobs = {"content": _token_logprobs(slot.engine.tokenizer, a.gen)} if body.logprobs else None
        yield event({"content": rest}, choice={"logprobs": logprobs})
    if a.tool_calls:
        yield event({"tool_calls": [{"index": i, **c} for i, c in enumerate(a.tool_calls)]})
    yield event({}, a.finish, choice=_ids(body, a.gen),
                **_extra(body, rollout_id, a.prompt_ids, a.gen, a.index))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _event({**chunk, "choices": [], "usage": _usage(a.prompt_ids, a.gen)})
    yield b"data: [DONE]\n\n"


async def completion_turn(gw, rollout_id: str, authorization: str | None, raw: bytes,
                          role: str | None = None) -> Response:
    """OpenAI text completion: one turn of the rollout."""
    t = begin_turn(gw, rollout_id, authorization, raw, role, CompletionIn)
    rollout, body, role, slot = t.rollout, t.body, t.role, t.slot
    tok = slot.engine.tokenizer
    prompt_ids, params = render.completion_request(tok, slot.engine, body)
    base = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or slot.name,
    }

    async def answer(deltas: TextDeltas | None = None) -> tuple[Generation, int]:
        if deltas is not None:
            deltas.start(tok, params, (), None, len(prompt_ids))
        on_tokens = None if deltas is None else deltas.add
        return await generate_turn(gw, rollout, slot, prompt_ids, params, on_tokens=on_tokens,
                                   role=role)

    if not body.stream:
        gen, index = await answer()
        text, _ = final_text(tok, gen, params)
        choice = {"index": 0, "text": text, "logprobs": _text_logprobs(tok, gen, body),
                  "finish_reason": gen.finish_reason, **_ids(body, gen)}
        return json_response({**base, "choices": [choice], "usage": _usage(prompt_ids, gen),
                      **_extra(body, rollout_id, prompt_ids, gen, index)})
    live = LiveTurn(answer)
    await live.opened()
    return EventStream(_completion_chunks(live, base, body, tok, params, rollout_id, prompt_ids),
                       live.cancel)


def _ids(body: Any, gen: Generation) -> dict[str, Any]:
    return {"token_ids": gen.response_ids} if body.return_token_ids else {}


def _text_logprobs(tok: Any, gen: Generation, body: CompletionIn) -> dict[str, Any] | None:
    if body.logprobs is None:
        return None
    tokens = [tok.decode([t]) for t in gen.response_ids]
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": gen.response_logprobs, "top_logprobs": None,
            "text_offset": offsets}


def _extra(body: Any, rollout_id: str, prompt_ids: list[int], gen: Generation,
           index: int) -> dict[str, Any]:
    """The answer's extra fields: tracetrain's, and the prompt ids when asked for."""
    extra: dict[str, Any] = {"tracetrain": turn_meta(rollout_id, index, gen)}
    if body.return_token_ids:
        extra["prompt_token_ids"] = prompt_ids
    return extra


async def _completion_chunks(live: LiveTurn, base: dict, body: CompletionIn, tok: Any,
                             params: SamplingParams, rollout_id: str, prompt_ids: list[int]
                             ) -> AsyncIterator[bytes]:
    """The text completion chunks of a live turn: the text as it comes, then (once recorded)
    its rest with the logprobs, the finish reason, the usage."""

    def event(text: str, finish: str | None = None, **more: Any) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _event({**base, "choices": [{**choice, **more.pop("choice", {})}], **more})

    try:
        async for text in live.text():
            yield event(text)
        gen, index = live.task.result()
    except Exception as exc:
        yield _event(await errors.body(exc))
        yield b"data: [DONE]\n\n"
        return
    rest = live.deltas.rest(final_text(tok, gen, params)[0])
    logprobs = _text_logprobs(tok, gen, body)
    if rest or logprobs:
        yield event(rest, choice={"logprobs": logprobs})
    yield event("", gen.finish_reason, choice=_ids(body, gen),
                **_extra(body, rollout_id, prompt_ids, gen, index))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _event({**base, "choices": [], "usage": _usage(prompt_ids, gen)})
    yield b"data: [DONE]\n\n"


chat_completions = endpoint(chat_turn)
completions = endpoint(completion_turn)


@router.get("/rollouts/{rollout_id}/v1/models", summary="OpenAI model list (the rollout's engine)")
@router.get("/rollouts/{rollout_id}/roles/{role}/v1/models",
            summary="OpenAI model list (the engine that serves the role)")
async def models(
    request: Request, rollout: RolloutHead = Depends(rollout_access), role: str | None = None
) -> dict:
    slot = request.app.state.gateway.slot_for(rollout, role_of(role, None))
    card = {"id": slot.name, "object": "model", "created": 0, "owned_by": "tracetrain"}
    return {"object": "list", "data": [card]}


# ------------------------------------------------------------------------------- installing

SCHEMAS: dict[str, Any] = {}  # request body schemas, merged into the OpenAPI components


def _openapi_body(model: type[BaseModel], role: bool = False) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    SCHEMAS.update(schema.pop("$defs", {}))
    SCHEMAS[model.__name__] = schema
    rid = {"type": "string", "minLength": 1, "maxLength": 200, "pattern": ID_PATTERN}
    params = [{"name": "rollout_id", "in": "path", "required": True, "schema": rid}]
    if role:  # a role's base URL: the role named in the path, whatever `model` the body sends
        role_schema = {"type": "string", "maxLength": 100, "pattern": f"^{ROLE_PATTERN.pattern}$"}
        params.append({"name": "role", "in": "path", "required": True, "schema": role_schema})
    return {
        "parameters": params,
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        },
    }


HOT_ROUTES = [
    ("/rollouts/{rollout_id}/v1/chat/completions", chat_completions, ChatCompletionIn),
    ("/rollouts/{rollout_id}/v1/completions", completions, CompletionIn),
]
TURNS = {"chat/completions": chat_turn, "completions": completion_turn}  # fast_routes.py serves these


def install(app: FastAPI, routes: list = HOT_ROUTES) -> None:
    """Register and document the model routes (fast_routes.py answers them first), each also under a
    role's base URL: /rollouts/{rollout_id}/roles/{role}/v1/..."""
    for path, serve, model in routes:
        for role in (False, True):
            app.add_api_route(
                path.replace("/v1/", "/roles/{role}/v1/", 1) if role else path,
                serve,
                methods=["POST"],
                tags=["openai"],
                summary=serve.__doc__.strip().split(":")[0],
                dependencies=[Security(keys._bearer)],
                openapi_extra=_openapi_body(model, role),
            )
    app.include_router(router)
    openapi = app.openapi

    def with_bodies() -> dict[str, Any]:
        schema = openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
        return schema

    app.openapi = with_bodies
