"""OpenAI request -> exact prompt token ids and SamplingParams, on the gateway side.

A full render of chat messages uses the engine tokenizer's chat template: the ids are those of
`apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True)` (computed as
transformers does it: render to text, then encode without adding special tokens). Under
`context: exact` most turns are not rendered in full (context.py). With a prompt_cache.PromptEncoder, prompts and
pieces of prompts seen before are not rendered or encoded again (exact by construction). Nothing the engine
cannot honour is dropped silently: n > 1, penalties, echo, suffix and best_of > 1 are 400s.
"""

from __future__ import annotations

from typing import Any

import orjson

from tracetrain.engines.base import Engine, PromptTooLong, SamplingParams
from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.prompt_cache import PromptEncoder
from tracetrain.gateway.schemas import ChatCompletionIn, CompletionIn, _Sampling


def template_text(
    tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool
) -> str:
    """The chat template's text for (messages, tools), as apply_chat_template(tokenize=False)."""
    kwargs = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # a template raising on the messages is the client's input at fault
        raise ApiError(
            400, f"the chat template cannot render these messages: {e}", "messages"
        ) from e


def full_prompt_ids(
    tokenizer: Any, messages: list[dict], tools: list | None, prompts: PromptEncoder | None = None
) -> list[int]:
    """The ids of the template's full render of (messages, tools), with the generation prompt."""

    def render() -> str:
        return template_text(tokenizer, messages, tools, True)

    if prompts is not None:
        return prompts.chat_ids(messages, tools, render)
    # What apply_chat_template(tokenize=True) does after rendering, minus its BatchEncoding.
    return tokenizer.encode(render(), add_special_tokens=False)


def chat_messages(body: ChatCompletionIn, raw: bytes) -> tuple[list[dict], list | None]:
    """(messages as dicts, tools or None) of a chat request, as the template receives them: the
    messages as sent (`raw`, the JSON pydantic validated into `body`), with content None where
    absent."""
    messages = orjson.loads(raw)["messages"]
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
    tokenizer: Any, engine: Engine, body: _Sampling, prompt_len: int, max_tokens: int | None
) -> SamplingParams:
    """Check the prompt fits: prompt_len + max_tokens <= engine.max_context (default max_tokens:
    all the room left, like vLLM)."""
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
    )


def tool_choice_parses(choice: Any, forced: str = "refuse", field: str = "tool_choice") -> bool:
    """Whether tool calls are parsed out of the answer, for a request's tool_choice in any API's
    spelling: auto (None, "auto", {"type": "auto"}) -> True; none ("none", {"type": "none"}) ->
    False (the tools stay in the prompt; the answer is text). A choice that forces a call
    ("required", {"type": "any"}, a named function or tool) needs decoding constrained to a call,
    which no engine here does: with `forced` "refuse" (the gateway's default) a 400 rather than a
    call the model may not make; with "as_auto" it is generated as auto (the model may answer
    without a call, and the harness sees that)."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto"):
        return True
    if kind == "none":
        return False
    if kind in ("required", "any", "function", "tool"):
        if forced == "as_auto":
            return True
        what = repr(kind) if isinstance(choice, str) else f"{{'type': {kind!r}, ...}}"
        raise ApiError(
            400,
            f"{field} {what} forces a tool call, which needs decoding constrained to one; the "
            "engine cannot do that: send 'auto' (or 'none'), or run the gateway with "
            "forced_tool_choice 'as_auto'",
            field,
        )
    raise ApiError(400, f"{field} {choice!r} is not one this API knows", field)


def plain_text_only(fmt: Any, field: str) -> None:
    """A structured-output request (JSON mode, a JSON schema) needs decoding constrained to it,
    which no engine here does: a 400 naming the field, rather than unconstrained text that the
    client would take for valid JSON. Plain text ({"type": "text"}) is what is produced anyway."""
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return
    raise ApiError(
        400,
        f"{field} {kind!r} needs decoding constrained to a format; the engine cannot do that "
        "(plain text only: leave it out, or ask for the format in the prompt)",
        field,
    )


def chat_max_tokens(body: ChatCompletionIn) -> int | None:
    """Refuse what the engine cannot honour; the request's max_tokens (or None)."""
    _reject(body, {"top_logprobs": 0})
    plain_text_only(getattr(body, "response_format", None), "response_format")
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
