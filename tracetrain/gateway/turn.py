"""One model call of a rollout, whatever API it came by: what every model route shares.

    rollout_of       the request's key and path -> the rollout (401/403/404/422 first)
    parse_body       the raw body -> the route's request model (422 naming the field)
    chat_answer      messages + tools -> prompt ids (context.py: the earlier turn's ids + the new
                     messages, or the template's full render) -> generate_turn -> the answer's
                     text and tool calls (parsed in the model's format: tool_calls.py)
    generate_turn    through the engine's pause gate: generate, check, record the turn (committed
                     before it returns), with its tool stats when tools were offered and calls
                     parsed (tool_calls.tool_stats: calls, parse failures, unknown tools)
    final_text       the answer's text as clients see it (stop id and stop string left out; the
                     recorded ids keep every token)

The routes (openai_routes: chat and text completions; responses_routes; anthropic_routes) only
shape requests into messages and answers into their API's JSON or events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from tracetrain.engines.base import (
    EngineError,
    Generation,
    OnTokens,
    PromptTooLong,
    SamplingParams,
)
from tracetrain.gateway import keys, render
from tracetrain.gateway.context import Built, messages_json
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.jsonbytes import dumps
from tracetrain.gateway.schemas.base import ID_PATTERN
from tracetrain.gateway.slots import EngineSlot
from tracetrain.gateway.streaming import TextDeltas
from tracetrain.gateway.tool_calls import tool_stats
from tracetrain.store import NewTurn, RolloutEnded, RolloutHead
from tracetrain.types import (
    DEFAULT_ROLE,
    RENDERED,
    TEMPLATE,
    TERMINAL_STATES,
    RolloutState,
    ToolStats,
    TraceError,
    check_generation,
    check_role,
)

_ID = re.compile(ID_PATTERN)
_REFUSED = object()  # a body pydantic's JSON parser refused


@dataclass(frozen=True)
class TurnStart:
    """What every model route knows before it renders: the rollout (its key checked), the parsed
    body, the body as sent (with_data routes only, else None), the role that calls, its slot."""

    rollout: RolloutHead
    body: Any
    data: Any
    role: str
    slot: EngineSlot


def begin_turn(gw, rollout_id: str, authorization: str | None, raw: bytes, role: str | None,
               model: type[BaseModel], *, with_data: bool = False) -> TurnStart:
    """The prologue of every turn handler, in its order: auth and the rollout (rollout_of), the
    body (parse_body; parse_json_body with `with_data`), the role (the path's, else the body's
    `model`: role_of), the engine slot that serves it."""
    rollout = rollout_of(gw, authorization, rollout_id)
    body, data = parse_json_body(model, raw) if with_data else (parse_body(model, raw), None)
    role = role_of(role, body.model)
    return TurnStart(rollout, body, data, role, gw.slot_for(rollout, role))


def rollout_of(gw, authorization: str | None, rid: str) -> RolloutHead:
    """Auth first (401/403/404), like the FastAPI routes' dependencies."""
    who = keys.identify(gw, authorization)
    if len(rid) > 200 or not _ID.fullmatch(rid):
        raise ApiError(
            422, f"rollout_id {rid[:50]!r} is not a valid id ({ID_PATTERN})", "rollout_id"
        )
    return keys.rollout_for(gw, who, rid)


def role_of(path_role: str | None, model: str | None) -> str:
    """The role that makes a call: the path's `/roles/{role}/` when the harness used a role's base
    URL, else the request's `model`, else DEFAULT_ROLE. 422 naming the field if it is not a role
    name (types.ROLE_PATTERN)."""
    role, field = (path_role, "role") if path_role is not None else (model, "model")
    if role is None or role == "":
        return DEFAULT_ROLE
    try:
        return check_role(role)
    except TraceError as e:
        raise ApiError(422, f"{field}: {e}", field) from None


def parse_body(model: type[BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def parse_json_body(model: type[BaseModel], raw: bytes) -> tuple[Any, Any]:
    """(the route's request model, the body as Python values) from one parse of the JSON, by
    pydantic's own JSON parser (so it accepts what parse_body accepts and reads numbers alike:
    integers of any size exact, NaN and Infinity as floats), then pydantic checks the values (for
    a route that reads the body as sent too: chat's messages reach the template with every
    field). A body either refuses is parsed again by parse_body, so the error names the fault in
    JSON's words ("an object", "an array")."""
    try:
        data = from_json(raw)
    except ValueError:
        data = _REFUSED
    else:
        try:
            return model.model_validate(data), data
        except ValidationError:
            pass
    body = parse_body(model, raw)  # raises, unless its JSON-mode validation accepts the values
    return body, (json.loads(raw) if data is _REFUSED else data)


async def generate_turn(
    gw,
    rollout: RolloutHead,
    slot: EngineSlot,
    prompt_ids: list[int],
    params: SamplingParams,
    context: tuple[str | None, str | None, int] = (None, None, 0),
    on_tokens: OnTokens | None = None,
    prompt_from: int | None = None,
    role: str = DEFAULT_ROLE,
    messages: bytes | None = None,
    tools_of: Callable[[Generation], ToolStats | None] | None = None,
) -> tuple[Generation, int]:
    """Generate and record one turn; returns (generation, turn index). `context`: how the prompt
    was built, recorded with the turn (store.TurnRecord); `on_tokens`: the engine streams to it;
    `prompt_from`: the earlier turn an exact prompt continues (store.NewTurn); `role`: the agent
    that made the call (role_of), recorded with the turn; `messages`: the JSON of the chat
    messages it was sent after those of `prompt_from` (all of them without it); `tools_of`: the
    generation's tool stats, recorded with the turn (None: none)."""
    store = gw.store
    rid = rollout.rollout_id
    if rollout.state in TERMINAL_STATES:
        raise RolloutEnded(
            f"rollout {rid!r} has ended ({rollout.state.value}); no more model calls"
        )
    if (adapter := gw.adapter_for(role, slot)) is not None:  # several policies: the role's
        params = replace(params, adapter=adapter)
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
        how, reason, reused = context
        index = await store.add_turn(rid, NewTurn(
            prompt_ids,
            gen.response_ids,
            gen.response_logprobs,
            gen.model_version,
            gen.finish_reason,
            context=how,
            context_reason=reason,
            reused_tokens=reused,
            prompt_from=prompt_from,
            role=role,
            messages=messages,
            tools=None if tools_of is None else tools_of(gen),
        ))
    return gen, index


def final_text(
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


def turn_meta(rollout_id: str, index: int, gen: Generation) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "turn_index": index, "model_version": gen.model_version}


def json_response(content: dict[str, Any]) -> Response:
    return Response(dumps(content), media_type="application/json")


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
    role: str = DEFAULT_ROLE,
) -> ChatAnswer:
    """A conversation (chat messages, chat tools) -> prompt ids (context.py: the earlier turn's
    ids + the new messages, or the template's full render) -> generate and record -> the answer,
    tool calls parsed when tools were offered (in the model's format: tool_calls.py), and what
    the answer did with them recorded with the turn (tool_calls.tool_stats).
    `sampling`: temperature, top_p, stop, seed. `decoding` (render.decoding): the constraint sent
    to the engine, and whether calls are parsed (not for tool_choice none: the answer stays
    text). `deltas` (streaming): fed the answer's text as the engine makes it."""
    tok = slot.engine.tokenizer

    def full() -> list[int]:
        return render.full_prompt_ids(tok, messages, tools, slot.prompts, slot.tools.inject)

    if gw.context == "exact":
        first = await gw.calls.first(rollout, role)
        sent = messages_json(messages)  # one serialization, for the match and the memory
        built = slot.exact.build(
            rollout.rollout_id, messages, tools, full, first=first, sent=sent, role=role
        )
    else:
        built = Built(full(), RENDERED, TEMPLATE, 0)
    prompt_ids = built.prompt_ids
    params = render.sampling_params(
        tok, slot.engine, sampling, len(prompt_ids), max_tokens, decoding.structured
    )
    if getattr(slot.engine, "answers_chat", False):  # an expert answers the messages themselves
        params = replace(params, conversation=(messages, tools))
    how = (built.context, built.reason, built.reused_tokens)
    parser = slot.tools.parser
    parse = bool(tools) and decoding.parse_calls
    on_tokens = None
    if deltas is not None:
        markers, safe = (parser.markers, parser.safe) if parse else ((), None)
        deltas.start(tok, params, markers, safe, len(prompt_ids))
        on_tokens = deltas.add
    new = messages[built.n_kept:]  # what this turn was sent beyond the turn it continues
    read: dict[str, Any] = {}  # the answer's content, calls and stop string: read once, recorded

    def tools_of(gen: Generation) -> ToolStats | None:
        text, read["stop"] = final_text(tok, gen, params, parser.markers if parse else ())
        read["content"], read["calls"] = parser.parse(text) if parse else (text, [])
        return tool_stats(parser, text, read["calls"], tools) if parse else None

    gen, index = await generate_turn(
        gw, rollout, slot, prompt_ids, params, how, on_tokens, built.from_turn, role,
        messages_json(new), tools_of,
    )
    gw.calls.made(rollout.rollout_id, role)

    answer = ChatAnswer(prompt_ids, gen, index, params, read["content"], read["calls"], read["stop"])
    if gw.context == "exact":
        prompt = prompt_ids if built.ids is None else built.ids
        slot.exact.answered(
            rollout.rollout_id, index, messages, tools, answer.message, prompt, gen.response_ids,
            sent=sent, role=role,
        )
    return answer


def decoding_for(
    gw, slot: EngineSlot, tools: list | None, choice: Any, fmt: Any = None,
    fmt_field: str = "response_format",
) -> render.Decoding:
    """render.decoding for a request to this slot's engine, with the gateway's tool parser and
    forced_tool_choice (every chat-shaped API calls it before generating)."""
    return render.decoding(
        slot.engine, slot.tools.parser, tools, choice, fmt, fmt_field,
        gw.forced_tool_choice,
    )


def endpoint(turn):
    """The FastAPI endpoint of a model route whose `turn(gw, rollout_id, authorization, raw)`
    fast_routes.py calls directly (same docstring: it is the route's summary)."""

    async def serve(request: Request) -> Response:
        return await turn(
            request.app.state.gateway,
            request.path_params["rollout_id"],
            request.headers.get("authorization"),
            await request.body(),
            request.path_params.get("role"),
        )

    serve.__doc__ = turn.__doc__
    return serve
