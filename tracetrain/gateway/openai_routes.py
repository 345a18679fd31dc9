"""OpenAI-compatible model routes, one base URL per rollout: {base}/rollouts/{rollout_id}/v1.

One request is one turn:
    prompt ids (context.py: the earlier turn's ids + the new messages, or the chat template's full
    render) -> check the rollout is open (queued -> running)
    -> engine.generate (through the engine's pause gate) -> record the turn (committed)
    -> answer (JSON, or SSE chunks then [DONE]).
The turn is in the store before the answer is sent, or, streaming (streaming.py), before its last
event: the text goes out as the engine makes it. The answer text is decoded from the response ids. Extra fields: "tracetrain" {rollout_id, turn_index, model_version} always;
"prompt_token_ids" and choices[0].token_ids when the request sets return_token_ids.

These two routes are the hot path: `chat_turn` and `completion_turn` take the gateway, the path's
rollout id, the Authorization header and the raw body, and return the answer; hot.py calls them
straight from ASGI, before FastAPI's middleware stack and router, which cost more than the rest of
a call. `install` also registers them as FastAPI routes, with the body schema, so the OpenAPI
document describes them (and an app mounted under a prefix still serves them, the slower way).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from tracetrain.engines.base import (
    EngineError,
    Generation,
    OnTokens,
    PromptTooLong,
    SamplingParams,
)
from tracetrain.gateway import errors, keys, render
from tracetrain.gateway.context import POLICY, RENDERED, Built
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.keys import rollout_access
from tracetrain.gateway.schemas import ID_PATTERN, ChatCompletionIn, CompletionIn
from tracetrain.gateway.slots import EngineSlot
from tracetrain.gateway.streaming import EventStream, LiveTurn, TextDeltas
from tracetrain.store import RolloutEnded, RolloutHead
from tracetrain.types import TERMINAL_STATES, RolloutState, TraceError, check_generation

router = APIRouter(tags=["openai"])
_ID = re.compile(ID_PATTERN)


def _rollout(gw, authorization: str | None, rid: str) -> RolloutHead:
    """Auth first (401/403/404), like the FastAPI routes' dependencies."""
    who = keys.identify(gw, authorization)
    if len(rid) > 200 or not _ID.fullmatch(rid):
        raise ApiError(
            422, f"rollout_id {rid[:50]!r} is not a valid id ({ID_PATTERN})", "rollout_id"
        )
    return keys.rollout_for(gw, who, rid)


def _parse(model: type[BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def generate_turn(
    gw,
    rollout: RolloutHead,
    slot: EngineSlot,
    prompt_ids: list[int],
    params: SamplingParams,
    context: tuple[str | None, str | None, int] = (None, None, 0),
    on_tokens: OnTokens | None = None,
) -> tuple[Generation, int]:
    """Generate and record one turn; returns (generation, turn index). `context`: how the prompt
    was built, recorded with the turn (store.TurnRecord); `on_tokens`: the engine streams to it."""
    store = gw.store
    rid = rollout.rollout_id
    if rollout.state in TERMINAL_STATES:
        raise RolloutEnded(
            f"rollout {rid!r} has ended ({rollout.state.value}); no more model calls"
        )
    async with slot.admit() as engine:  # waits here while paused; in flight until recorded
        if rollout.state == RolloutState.queued:
            await store.start(rid)
        try:
            if on_tokens is None:  # an engine written before streaming takes two arguments
                gen = await engine.generate(prompt_ids, params)
            else:
                gen = await engine.generate(prompt_ids, params, on_tokens=on_tokens)
        except (EngineError, PromptTooLong):
            raise
        except Exception as e:  # an engine bug is still the engine failing, not the client
            raise EngineError(f"{type(e).__name__}: {e}", status=502) from e
        try:
            if not isinstance(gen, Generation):
                raise TraceError(f"engine returned a {type(gen).__name__}, not a Generation")
            # the prompt ids are the gateway's own; what the engine made is checked as a Turn would
            check_generation(gen.response_ids, gen.response_logprobs, gen.model_version)
        except TraceError as e:
            raise EngineError(f"engine returned an invalid generation: {e}", status=502) from e
        index = await store.add_turn(
            rid,
            prompt_ids,
            gen.response_ids,
            gen.response_logprobs,
            gen.model_version,
            gen.finish_reason,
            context,
        )
    return gen, index


def _text(
    tokenizer: Any, gen: Generation, params: SamplingParams, keep: tuple[str, ...] = ()
) -> tuple[str, str | None]:
    """(the answer's text, the stop string that ended it or None). Special tokens are left out,
    but those in `keep` (a tool parser's markers). Like OpenAI, a stop sequence is not part of
    the text: a stop id at the end is left out, and the text ends before a stop string; the
    recorded ids keep every token generated."""
    ids = gen.response_ids
    if gen.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids:
        ids = ids[:-1]
    text = render.answer_text(tokenizer, ids, keep)
    if params.stop and gen.finish_reason == "stop":
        found = [(text.find(s), s) for s in params.stop if s in text]
        if found:
            at, matched = min(found)
            return text[:at], matched
    return text, None


def _usage(prompt_ids: list[int], gen: Generation) -> dict[str, int]:
    p, c = len(prompt_ids), len(gen.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _meta(rollout_id: str, index: int, gen: Generation) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "turn_index": index, "model_version": gen.model_version}


def _json(content: dict[str, Any]) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: %s\n\n" % orjson.dumps(chunk)


def _token_logprobs(tokenizer: Any, gen: Generation) -> list[dict[str, Any]]:
    return [
        {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(gen.response_ids, gen.response_logprobs, strict=True)
    ]


@dataclass
class ChatAnswer:
    """One chat-shaped turn, generated and recorded: what every chat-shaped API answers from."""

    prompt_ids: list[int]
    gen: Generation
    index: int
    params: SamplingParams
    content: str | None  # the text, without the tool-call blocks parsed out of it
    tool_calls: list[dict[str, Any]]  # OpenAI chat shape: {id, type, function: {name, arguments}}
    stop_string: str | None = None  # the stop string that ended generation

    @property
    def finish(self) -> str | None:
        return "tool_calls" if self.tool_calls else self.gen.finish_reason

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message, as a chat client sends it back."""
        return {"role": "assistant", "content": self.content, "tool_calls": self.tool_calls}


async def chat_answer(
    gw,
    rollout: RolloutHead,
    slot: EngineSlot,
    messages: list[dict],
    tools: list | None,
    sampling: Any,
    max_tokens: int | None,
    decoding: render.Decoding = render.Decoding(),
    deltas: TextDeltas | None = None,
) -> ChatAnswer:
    """A conversation (chat messages, chat tools) -> prompt ids (context.py: the earlier turn's
    ids + the new messages, or the template's full render) -> generate and record -> the answer,
    tool calls parsed when tools were offered (in the model's format: tool_calls.py).
    `sampling`: temperature, top_p, stop, seed. `decoding` (render.decoding): the constraint sent
    to the engine, and whether calls are parsed (not for tool_choice none: the answer stays
    text). `deltas` (streaming): fed the answer's text as the engine makes it."""
    tok = slot.engine.tokenizer

    def full() -> list[int]:
        return render.full_prompt_ids(tok, messages, tools, slot.prompts)

    if gw.context == "exact":
        first = rollout.state == RolloutState.queued
        built = slot.exact.build(rollout.rollout_id, messages, tools, full, first=first)
    else:
        built = Built(full(), RENDERED, POLICY, 0)
    prompt_ids = built.prompt_ids
    params = render.sampling_params(
        tok, slot.engine, sampling, len(prompt_ids), max_tokens, decoding.structured
    )
    how = (built.context, built.reason, built.reused_tokens)
    parser = slot.tool_parser(gw.tool_parser)
    parse = bool(tools) and decoding.parse_calls
    on_tokens = None
    if deltas is not None:
        markers, safe = (parser.markers, parser.safe) if parse else ((), None)
        deltas.start(tok, params, markers, safe, len(prompt_ids))
        on_tokens = deltas.add
    gen, index = await generate_turn(gw, rollout, slot, prompt_ids, params, how, on_tokens)

    text, stop_string = _text(tok, gen, params, parser.markers if parse else ())
    content, tool_calls = parser.parse(text) if parse else (text, [])
    answer = ChatAnswer(prompt_ids, gen, index, params, content, tool_calls, stop_string)
    if gw.context == "exact":
        prompt = prompt_ids if built.ids is None else built.ids
        slot.exact.answered(
            rollout.rollout_id, messages, tools, answer.message, prompt, gen.response_ids
        )
    return answer


def decoding_for(
    gw, slot: EngineSlot, tools: list | None, choice: Any, fmt: Any = None,
    fmt_field: str = "response_format",
) -> render.Decoding:
    """render.decoding for a request to this slot's engine, with the gateway's tool parser and
    forced_tool_choice (every chat-shaped API calls it before generating)."""
    return render.decoding(
        slot.engine, slot.tool_parser(gw.tool_parser), tools, choice, fmt, fmt_field,
        gw.forced_tool_choice,
    )


async def chat_turn(gw, rollout_id: str, authorization: str | None, raw: bytes) -> Response:
    """OpenAI chat completion: one turn of the rollout."""
    rollout = _rollout(gw, authorization, rollout_id)
    body: ChatCompletionIn = _parse(ChatCompletionIn, raw)
    slot = gw.slot_for(rollout)
    max_tokens = render.chat_max_tokens(body)
    messages, tools = render.chat_messages(body, raw)
    how = decoding_for(gw, slot, tools, body.tool_choice, getattr(body, "response_format", None))

    def answer(deltas: TextDeltas | None = None):
        return chat_answer(gw, rollout, slot, messages, tools, body, max_tokens, how, deltas)

    chunk = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.model or slot.name,
    }
    if not body.stream:
        return _json(_chat_completion(chunk, body, slot, rollout_id, await answer()))
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


async def completion_turn(gw, rollout_id: str, authorization: str | None, raw: bytes) -> Response:
    """OpenAI text completion: one turn of the rollout."""
    rollout = _rollout(gw, authorization, rollout_id)
    body: CompletionIn = _parse(CompletionIn, raw)
    slot = gw.slot_for(rollout)
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
        return await generate_turn(gw, rollout, slot, prompt_ids, params, on_tokens=on_tokens)

    if not body.stream:
        gen, index = await answer()
        text, _ = _text(tok, gen, params)
        choice = {"index": 0, "text": text, "logprobs": _text_logprobs(tok, gen, body),
                  "finish_reason": gen.finish_reason, **_ids(body, gen)}
        return _json({**base, "choices": [choice], "usage": _usage(prompt_ids, gen),
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
    extra: dict[str, Any] = {"tracetrain": _meta(rollout_id, index, gen)}
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
    rest = live.deltas.rest(_text(tok, gen, params)[0])
    logprobs = _text_logprobs(tok, gen, body)
    if rest or logprobs:
        yield event(rest, choice={"logprobs": logprobs})
    yield event("", gen.finish_reason, choice=_ids(body, gen),
                **_extra(body, rollout_id, prompt_ids, gen, index))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _event({**base, "choices": [], "usage": _usage(prompt_ids, gen)})
    yield b"data: [DONE]\n\n"


def endpoint(turn):
    """The FastAPI endpoint of a model route whose `turn(gw, rollout_id, authorization, raw)`
    hot.py calls directly (same docstring: it is the route's summary)."""

    async def serve(request: Request) -> Response:
        return await turn(
            request.app.state.gateway,
            request.path_params["rollout_id"],
            request.headers.get("authorization"),
            await request.body(),
        )

    serve.__doc__ = turn.__doc__
    return serve


chat_completions = endpoint(chat_turn)
completions = endpoint(completion_turn)


@router.get("/rollouts/{rollout_id}/v1/models", summary="OpenAI model list (the rollout's engine)")
async def models(request: Request, rollout: RolloutHead = Depends(rollout_access)) -> dict:
    slot = request.app.state.gateway.slot_for(rollout)
    card = {"id": slot.name, "object": "model", "created": 0, "owned_by": "tracetrain"}
    return {"object": "list", "data": [card]}


# ------------------------------------------------------------------------------- installing

SCHEMAS: dict[str, Any] = {}  # request body schemas, merged into the OpenAPI components


def _openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    SCHEMAS.update(schema.pop("$defs", {}))
    SCHEMAS[model.__name__] = schema
    rid = {"type": "string", "minLength": 1, "maxLength": 200, "pattern": ID_PATTERN}
    return {
        "parameters": [{"name": "rollout_id", "in": "path", "required": True, "schema": rid}],
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
TURNS = {"chat/completions": chat_turn, "completions": completion_turn}  # hot.py serves these


def install(app: FastAPI, routes: list = HOT_ROUTES) -> None:
    """Register and document the model routes (hot.py answers them first)."""
    for path, endpoint, model in routes:
        app.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            tags=["openai"],
            summary=endpoint.__doc__.strip().split(":")[0],
            dependencies=[Security(keys._bearer)],
            openapi_extra=_openapi_body(model),
        )
    app.include_router(router)
    openapi = app.openapi

    def with_bodies() -> dict[str, Any]:
        schema = openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
        return schema

    app.openapi = with_bodies
