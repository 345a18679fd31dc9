"""OpenAI request -> exact prompt token ids and SamplingParams, on the gateway side.

A full render of chat messages uses the engine tokenizer's chat template: the ids are those of
`apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True)` (computed as
transformers does it: render to text, then encode without adding special tokens). Under
`context: exact` most turns are not rendered in full (context.py). With a
prompt_cache.PromptEncoder, prompts and pieces of prompts seen before are not rendered or encoded
again (exact by construction). Nothing the engine cannot honour is dropped silently: n > 1,
penalties, echo, suffix and best_of > 1 are 400s, and so are a forced tool choice and a JSON format
where the engine cannot constrain decoding (`decoding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracetrain.engines.base import Engine, PromptTooLong, SamplingParams, can_constrain
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.prompt_cache import PromptEncoder
from tracetrain.gateway.schemas.openai import ChatCompletionIn, CompletionIn, _Sampling
from tracetrain.gateway.tool_calls import Parser
from tracetrain.models.tool_prompt import chat_text


def answer_text(tokenizer: Any, ids: list[int], keep: tuple[str, ...] = ()) -> str:
    """The text of response ids as an answer shows it: special tokens left out, but those in
    `keep` (a tool parser's markers, which it must see)."""
    if not keep:
        return tokenizer.decode(ids, skip_special_tokens=True)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    for special in tokenizer.all_special_tokens:
        if special not in keep:
            text = text.replace(special, "")
    return text


def template_text(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None,
    generation_prompt: bool,
    inject: bool = False,
) -> str:
    """The chat template's text for (messages, tools), as apply_chat_template(tokenize=False); with
    `inject` (a template that drops tools), with the tool block in the messages
    (models/tool_prompt.py)."""
    try:
        return chat_text(
            tokenizer, messages, tools, generation_prompt=generation_prompt, inject=inject
        )
    except Exception as e:  # a template raising on the messages is the client's input at fault
        raise ApiError(
            400, f"the chat template cannot render these messages: {e}", "messages"
        ) from e


def full_prompt_ids(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None,
    prompts: PromptEncoder | None = None,
    inject: bool = False,
) -> list[int]:
    """The ids of the template's full render of (messages, tools), with the generation prompt
    (`inject`: template_text's)."""

    def render() -> str:
        return template_text(tokenizer, messages, tools, True, inject)

    if prompts is not None:
        return prompts.chat_ids(messages, tools, render)
    # What apply_chat_template(tokenize=True) does after rendering, minus its BatchEncoding.
    return tokenizer.encode(render(), add_special_tokens=False)


def chat_messages(body: ChatCompletionIn, data: dict) -> tuple[list[dict], list | None]:
    """(messages as dicts, tools or None) of a chat request, as the template receives them: the
    messages as sent (`data`, the JSON values pydantic validated into `body`), with content None
    where absent."""
    messages = data["messages"]
    return [m if "content" in m else {**m, "content": None} for m in messages], body.tools or None


def completion_prompt_ids(tokenizer: Any, body: CompletionIn) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(
                400, f"prompt holds {len(prompt)} prompts; only one is supported", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = len(tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt token id {bad} is outside the vocabulary (size {vocab})", "prompt"
            )
    if not ids:
        raise ApiError(400, "prompt is empty", "prompt")
    return ids


def _reject(body: _Sampling, extra: dict[str, Any]) -> None:
    if body.n not in (None, 1):
        raise ApiError(400, f"n is {body.n}; only n=1 is supported (one turn per request)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (got {value})", name)
    for name, default in extra.items():
        value = getattr(body, name, None)
        if value not in (None, default):
            raise ApiError(400, f"{name}={value!r} is not supported", name)


def stops(tokenizer: Any, stop: str | list[str] | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop token ids, stop strings) of a request's `stop`: a stop that is one token ends
    generation at that id; a longer one when the text of the tokens generated completes it."""
    if stop is None:
        return (), ()
    asked = [stop] if isinstance(stop, str) else stop
    if len(asked) > 4:
        raise ApiError(400, f"stop has {len(asked)} entries; at most 4", "stop")
    ids, strings = [], []
    for k, s in enumerate(asked):
        if not s:
            raise ApiError(400, f"stop[{k}] is empty", "stop")
        toks = tokenizer.encode(s, add_special_tokens=False)
        if len(toks) == 1:
            ids.append(toks[0])
        else:
            strings.append(s)
    return tuple(ids), tuple(strings)


def sampling_params(
    tokenizer: Any,
    engine: Engine,
    body: _Sampling,
    prompt_len: int,
    max_tokens: int | None,
    structured: dict[str, Any] | None = None,
) -> SamplingParams:
    """Check the prompt fits: prompt_len + max_tokens <= engine.max_context (default max_tokens:
    all the room left, like vLLM). `structured`: the constraint (Decoding.structured)."""
    stop_ids, stop_strings = stops(tokenizer, body.stop)
    room = engine.max_context - prompt_len
    if max_tokens is None:
        if room < 1:
            raise PromptTooLong(
                f"prompt is {prompt_len} tokens; the context limit is {engine.max_context}, "
                "which leaves no room for a response"
            )
        max_tokens = room
    elif max_tokens > room:
        raise PromptTooLong(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
            f"of {engine.max_context} tokens"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        stop_token_ids=stop_ids,
        stop=stop_strings,
        seed=body.seed,
        structured=structured,
    )


@dataclass(frozen=True)
class Decoding:
    """How a chat-shaped turn is generated and read: `structured`, the constraint sent to the
    engine (vLLM's structured_outputs object) or None; `parse_calls`, whether tool calls are
    parsed out of the answer."""

    parse_calls: bool = True
    structured: dict[str, Any] | None = None


_CHOICE_STRINGS = {"auto": "auto", "none": "none", "required": "required"}
_CHOICE_TYPES = {
    "auto": "auto", "none": "none", "any": "required", "function": "named", "tool": "named"
}


def choice_kind(choice: Any) -> str | None:
    """auto | none | required | named, for a tool_choice in any API's spelling (None: absent, a
    string, or an object's "type"); None if it is none of them."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return _CHOICE_STRINGS.get(choice)
    return _CHOICE_TYPES.get(choice.get("type")) if isinstance(choice, dict) else None


CANNOT = "cannot constrain decoding (only an upstream engine on vLLM can)"


def decoding(
    engine: Engine,
    parser: Parser,
    tools: list | None,
    choice: Any,
    fmt: Any = None,
    fmt_field: str = "response_format",
    forced: str = "refuse",
) -> Decoding:
    """The Decoding of a request, from its tool choice (`choice`, in any API's spelling) and its
    response format (`fmt`, chat's response_format or Responses' text.format, at `fmt_field`).

    Tool choice: auto (None, "auto", {"type": "auto"}) parses calls; none ("none",
    {"type": "none"}) leaves the answer text (the tools stay in the prompt). A choice that forces a
    call ("required", {"type": "any"}: one or more calls of the offered tools; a named function
    or tool: one call of it) is constrained to calls in the parser's format (tool_calls.py) on an
    engine that constrains decoding. Where the engine cannot, or the parser has no constraint:
    with `forced` "refuse" a 400 rather than a call the model may not make; with "as_auto" it is
    generated as auto (the model may answer without a call, and the harness sees that).

    Format: text (or none) is what is produced anyway; JSON mode and a JSON schema are
    constrained on an engine that can, a 400 elsewhere. A format with tools offered (and a tool
    choice other than none) is a 400: one answer cannot be held to both."""
    structured = format_constraint(engine, fmt, fmt_field)
    kind = choice_kind(choice)
    if kind is None:
        raise ApiError(400, f"tool_choice {choice!r} is not one this API knows", "tool_choice")
    if structured is not None and tools and kind != "none":
        raise ApiError(
            400,
            f"{fmt_field} and tools (tool_choice {kind}) together: one answer cannot be held to a "
            "format and be tool calls; send tool_choice 'none' or leave one out",
            fmt_field,
        )
    if kind in ("auto", "none"):
        return Decoding(kind == "auto", structured)
    return Decoding(True, forced_call(engine, parser, tools, choice, kind == "named", forced))


def forced_call(
    engine: Engine, parser: Parser, tools: list | None, choice: Any, named: bool, forced: str
) -> dict[str, Any] | None:
    """The constraint of a tool choice that forces a call (see `decoding`); None: served as auto."""
    what = repr(choice) if isinstance(choice, str) else f"{{'type': {choice['type']!r}, ...}}"
    if not can_constrain(engine) or parser.constraint is None:
        if forced == "as_auto":
            return None
        why = (
            f"engine {engine.name!r} {CANNOT}"
            if not can_constrain(engine)
            else f"the tool parser {parser.name!r} has no constraint for its calls"
        )
        raise ApiError(
            400,
            f"tool_choice {what} forces a tool call, which needs decoding constrained to one; "
            f"{why}: send 'auto' (or 'none'), or run the gateway with forced_tool_choice "
            "'as_auto'",
            "tool_choice",
        )
    offered = function_tools(tools)
    if not offered:
        raise ApiError(
            400, f"tool_choice {what} forces a call, but no tools are offered", "tool_choice"
        )
    if not named:
        return parser.constraint(offered, False)
    name = choice.get("name") or (choice.get("function") or {}).get("name")
    chosen = [t for t in offered if t["function"]["name"] == name]
    if not chosen:
        raise ApiError(
            400, f"tool_choice names the tool {name!r}, which is not among the tools offered",
            "tool_choice",
        )
    return parser.constraint(chosen[:1], True)


def function_tools(tools: list | None) -> list[dict[str, Any]]:
    """The chat tools, each checked to be {"type": "function", "function": {"name": str, ...}}."""
    for k, t in enumerate(tools or ()):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(400, f"tools[{k}] is not a function tool with a name", "tools")
    return list(tools or ())


def format_constraint(engine: Engine, fmt: Any, field: str) -> dict[str, Any] | None:
    """vLLM's structured_outputs object for a response format: None for text (or none),
    {"json_object": True} for json_object, {"json": schema} for json_schema (chat's
    {"json_schema": {"name", "schema"}}, Responses' {"name", "schema"}); a 400 naming `field` for
    another type, a json_schema without a schema, or any of them on an engine that cannot
    constrain (rather than unconstrained text the client would take for valid JSON)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return None
    if not can_constrain(engine):
        raise ApiError(
            400,
            f"{field} {kind!r} needs decoding constrained to a format; engine {engine.name!r} "
            f"{CANNOT}: leave it out, or ask for the format in the prompt",
            field,
        )
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ApiError(400, f"{field} {kind!r} is not text, json_object or json_schema", field)
    spec = fmt.get("json_schema", fmt)  # chat nests name and schema under json_schema
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field} json_schema has no schema (a JSON schema object)", field)
    return {"json": schema}


def chat_max_tokens(body: ChatCompletionIn) -> int | None:
    """Refuse what the engine cannot honour; the request's max_tokens (or None)."""
    _reject(body, {"top_logprobs": 0})
    mt, mct = body.max_tokens, body.max_completion_tokens
    if mt is not None and mct is not None and mt != mct:
        raise ApiError(
            400, f"max_tokens ({mt}) and max_completion_tokens ({mct}) differ", "max_tokens"
        )
    return mct or mt


def completion_request(tokenizer: Any, engine: Engine, body: CompletionIn):
    """(prompt_ids, SamplingParams) for a text completion."""
    _reject(body, {"echo": False, "best_of": 1, "suffix": None})
    prompt_ids = completion_prompt_ids(tokenizer, body)
    return prompt_ids, sampling_params(tokenizer, engine, body, len(prompt_ids), body.max_tokens)
