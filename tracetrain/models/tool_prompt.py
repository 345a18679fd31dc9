"""Tools for a chat template that drops them: the tool block written into the messages.

Many chat templates render `tools` (Qwen's, Llama 3's, Mistral's); many do not (SmolLM2's, most
base-model ChatML templates): `apply_chat_template(messages, tools=...)` renders the same text with
and without them, and the model never sees its tools. For such a template the tools are written
into the conversation before the template sees it, in the Hermes format (the one Qwen 2.5's template
writes, and the gateway's hermes parser reads):

    system      the conversation's system message (one is added first where there is none), then
                a blank line and TOOL_BLOCK: the tools as JSON, one per line, inside <tools></tools>,
                and how to call one: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    assistant   a message with tool calls: its text, then each call on its own lines as
                <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call> (ARGS parsed JSON where
                the arguments are JSON text)
    tool        consecutive tool results become one user message, each result as
                <tool_response>\\n{content}\\n</tool_response>, joined by newlines

The template then renders plain system, user and assistant messages, which every template can.
`drops_tools(tokenizer)` is the check (render a probe with and without tools, compare);
`chat_text(tokenizer, messages, tools, ...)` renders with the block where `inject` says so. The
gateway (every API), the warm start and `tracetrain sft` render through it, so the ids trained on
are the ids the engine saw.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_FORMAT = "hermes"  # the tool-call format of the block (gateway/tool_calls.py parses it)

TOOL_BLOCK = """# Tools

You can call the functions below. Their signatures are inside <tools></tools>, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, write its name and arguments as one JSON object inside <tool_call></tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}}
</tool_call>"""

_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "tracetrain_probe", "description": "probe", "parameters": {"type": "object"}}}]
_PROBE = [{"role": "user", "content": "?"}]


def drops_tools(tokenizer: Any) -> bool:
    """The tokenizer's chat template renders a conversation alike with and without `tools` (or
    fails with them): it does not show the model its tools. False without a chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    without = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(
            _PROBE, tools=_PROBE_TOOLS, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that cannot take tools at all drops them too
        return True
    return with_tools == without


def tool_block(tools: list[dict]) -> str:
    """TOOL_BLOCK with `tools` (chat-shaped: {"type": "function", "function": {...}}), one JSON
    object per line, as given."""
    return TOOL_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _text(content: Any) -> str:
    """A message's content as text: a string as it is, None as "", text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)


def _arguments(args: Any) -> Any:
    """A call's arguments as a JSON value: JSON text parsed, anything else as it is."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return {} if args is None else args


def call_text(call: dict) -> str:
    """One tool call (OpenAI chat shape, or {"name", "arguments"}) in the block's format."""
    f = call.get("function", call)
    body = {"name": f.get("name"), "arguments": _arguments(f.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _assistant(message: dict) -> dict:
    parts = [_text(message.get("content"))] if _text(message.get("content")) else []
    parts += [call_text(c) for c in message.get("tool_calls") or ()]
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join(parts)
    return out


def with_tool_block(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as a template without tools must see it (module docstring): the tool block
    in the system message, tool calls and tool results as text. Messages are not changed in place."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        elif role == "assistant" and m.get("tool_calls"):
            out.append(_assistant(m))
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = tool_block(tools)
        if out and out[0].get("role") in ("system", "developer"):
            system = _text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{block}" if system else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def chat_text(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None,
    *,
    generation_prompt: bool,
    inject: bool,
) -> str:
    """apply_chat_template(messages, tools=tools, tokenize=False), or with `inject` the template's
    rendering of `with_tool_block(messages, tools)` (no `tools` passed to it)."""
    if inject:
        return tokenizer.apply_chat_template(
            with_tool_block(messages, tools), add_generation_prompt=generation_prompt,
            tokenize=False,
        )
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )


BLOCK_SETTINGS = ("auto", TOOL_FORMAT)  # the gateway.tool_parser values that write the block


def writes_block(tokenizer: Any, tool_parser: str) -> bool:
    """Whether tools are written into the messages for this tokenizer under `gateway.tool_parser`
    (BLOCK_SETTINGS, where the template drops tools; never for another format or `off`)."""
    return tool_parser in BLOCK_SETTINGS and drops_tools(tokenizer)


def reply_ids(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None,
    reply: dict,
    *,
    inject: bool,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """The token ids of an assistant `reply` ({"content", "tool_calls"}) to `messages`, as the
    policy would generate them: the template's text for the reply at that position,

        text = render(messages + [reply])[len(render(messages, generation_prompt)):]

    encoded, and cut after its first stop id (eos, or one of `stop_ids`: the template's turn end);
    eos appended when the text holds none. ValueError when the rendering with the reply does not
    begin with the rendering without it (a template that rewrites earlier messages when one is
    added): such a reply has no ids of its own."""
    shorter = chat_text(tokenizer, messages, tools, generation_prompt=True, inject=inject)
    longer = chat_text(tokenizer, [*messages, reply], tools, generation_prompt=False, inject=inject)
    if not longer.startswith(shorter):
        raise ValueError("the chat template renders the earlier messages otherwise once a reply "
                         "follows them: the reply's tokens cannot be cut out")
    ids = tokenizer.encode(longer[len(shorter):], add_special_tokens=False)
    stops = {tokenizer.eos_token_id, *stop_ids}
    end = next((k for k, t in enumerate(ids) if t in stops), None)
    return ids[: end + 1] if end is not None else [*ids, tokenizer.eos_token_id]
