"""Tool calls out of the model's text, in the model's own format: a registry of parsers.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around
                 them kept (Hermes, Qwen 2.5 / Qwen3, many fine-tunes)
    llama3_json  the whole answer is one JSON object {"name": ..., "parameters": {...}} (or several
                 joined by ";"), optionally after <|python_tag|> (Llama 3.1 / 3.2 / 3.3)
    mistral      [TOOL_CALLS] then a JSON list [{"name": ..., "arguments": {...}}, ...], or
                 [TOOL_CALLS]name[ARGS]{...} repeated (Mistral v0.3 and later templates)

Only when the request offered tools. A call that is not valid JSON with a string name stays plain
text (never guessed). The recorded turn is unaffected: it holds the raw response ids. Calls come
out in OpenAI's chat shape: {id, type: "function", function: {name, arguments: JSON string}}.

`parser_for(name, chat_template)`: the parser named, or for "auto" the one whose markers the
template writes (hermes when none does). `register(name, markers=..., safe=..., constraint=...,
opened=...)` adds one: a function text -> (content or None, calls), where `markers` are special
tokens it must see in the text (the gateway keeps those, and strips the other special tokens, when
it decodes an answer) and `safe(text)` is how many characters of an unfinished answer are
certainly content whatever follows (what streaming may send before the answer ends; by default
none: the content is sent at the end). Content is the text outside the calls with its trailing
whitespace stripped, so that text streamed before a call is the start of it.

`opened(text)` is how many calls the text began, parsed or not (by default 0), and
`tool_stats(parser, text, calls, tools)` what the gateway records with a turn (types.ToolStats):
calls = len(calls), parse_failures = max(0, opened(text) - calls), unknown = the calls whose name
is none of `tools`' names.

    hermes       opened = occurrences of <tool_call>
    llama3_json  opened = 1 when the answer begins like a call ("{" or <|python_tag|>), else 0
    mistral      opened = 1 when [TOOL_CALLS] is in it, else 0

`constraint(tools, one)` writes a forced tool choice as constrained decoding: vLLM's
structured_outputs object holding an xgrammar structural tag under which the answer is tool calls
only, in the parser's own format, each a call of one of the chat-shaped `tools` with arguments
valid for its `parameters` (a JSON object); exactly one call if `one`, else one or more. None
(mistral: its calls begin with a special token, spelled two ways by template version): the format
cannot be forced.

    hermes       <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>, with or without the
                 two newlines (Qwen's templates write them, others may not); calls joined by an
                 optional newline
    llama3_json  {"name": NAME, "parameters": ARGS}; one call (Llama 3.x templates take one per
                 message)
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracetrain.types import ToolStats

Calls = list[dict[str, Any]]
Parse = Callable[[str], tuple[str | None, Calls]]


Safe = Callable[[str], int]
Constraint = Callable[[list[dict[str, Any]], bool], dict[str, Any]]


def _nothing(text: str) -> int:
    return 0


@dataclass(frozen=True)
class Parser:
    name: str
    parse: Parse
    markers: tuple[str, ...] = ()  # special tokens the parser needs to see
    safe: Safe = _nothing  # characters of an unfinished answer that are certainly content
    constraint: Constraint | None = None  # a forced tool choice as constrained decoding
    opened: Safe = _nothing  # calls the text began, parsed or not


PARSERS: dict[str, Parser] = {}


def register(
    name: str,
    *,
    markers: tuple[str, ...] = (),
    safe: Safe = _nothing,
    constraint: Constraint | None = None,
    opened: Safe = _nothing,
) -> Callable[[Parse], Parse]:
    def add(parse: Parse) -> Parse:
        PARSERS[name] = Parser(name, parse, markers, safe, constraint, opened)
        return parse

    return add


def tool_stats(parser: Parser, text: str, calls: Calls, tools: list[dict[str, Any]] | None) -> ToolStats:
    """A turn's tool stats (module docstring): calls parsed, calls begun that did not parse
    (parser.opened(text) - calls, at least 0), parsed calls of a name none of the chat-shaped
    `tools` has."""
    names = {(t.get("function") or {}).get("name") for t in tools or () if isinstance(t, dict)}
    unknown = sum(c["function"]["name"] not in names for c in calls)
    return ToolStats(len(calls), max(0, parser.opened(text) - len(calls)), unknown)


def structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs object for an xgrammar structural-tag format (vLLM takes the
    structural tag as JSON text)."""
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def call_tags(tools: list[dict[str, Any]], begin: str, key: str, end: str) -> list[dict[str, Any]]:
    """Structural-tag formats of a call of each of `tools`: `begin`, `{"name": NAME, "KEY": ` (NAME
    the tool's name as a JSON string), its arguments as a JSON object valid for its `parameters`,
    then `end` (which closes the object)."""
    return [
        {
            "type": "tag",
            "begin": f'{begin}{{"name": {json.dumps(f["name"])}, "{key}": ',
            "content": {
                "type": "json_schema",
                "json_schema": {"type": "object", **(f.get("parameters") or {})},
            },
            "end": end,
        }
        for f in (t["function"] for t in tools)
    ]


def one_or_more(call: dict[str, Any], separator: str) -> dict[str, Any]:
    """A structural-tag format for `call` repeated: one or more, joined by text matching the regex
    `separator`."""
    joined = {"type": "sequence", "elements": [{"type": "regex", "pattern": separator}, call]}
    return {"type": "sequence", "elements": [call, {"type": "star", "content": joined}]}


def before(marker: str) -> Safe:
    """safe(text) for a format whose calls begin with `marker`: the text before it (or before a
    tail that may be its start), less trailing whitespace."""

    def safe(text: str) -> int:
        at = text.find(marker)
        if at < 0:
            at = len(text)
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if marker.startswith(text[-n:]):
                    at -= n
                    break
        return len(text[:at].rstrip())

    return safe


def _call(name: str, args: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


def _named(obj: Any, args_key: str = "arguments") -> dict[str, Any] | None:
    """A call from a parsed JSON object {"name": str, args_key: ...}; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get(args_key, {}))


_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes_constraint(tools: list[dict[str, Any]], one: bool) -> dict[str, Any]:
    tags = [
        tag
        for nl in ("\n", "")
        for tag in call_tags(tools, "<tool_call>" + nl, "arguments", "}" + nl + "</tool_call>")
    ]
    call = {"type": "or", "elements": tags}
    return structural_tag(call if one else one_or_more(call, "\n?"))


def _hermes_opened(text: str) -> int:
    return text.count("<tool_call>")


@register("hermes", safe=before("<tool_call>"), constraint=hermes_constraint, opened=_hermes_opened)
def parse_hermes(text: str) -> tuple[str | None, Calls]:
    """(content without the parsed blocks or None if nothing is left, calls)."""
    calls, keep, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = _named(json.loads(m.group(1)))
        except ValueError:
            continue
        if call is None:
            continue
        calls.append(call)
        keep.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    keep.append(text[last:])
    content = "".join(keep).rstrip()
    return content or None, calls


def _llama3_safe(text: str) -> int:
    """All of it once it begins with neither "{" nor <|python_tag|> (so it is not a call)."""
    body = text.lstrip()
    if not body or body[0] == "{" or "<|python_tag|>".startswith(body[:14]):
        return 0
    return len(text)


def _llama3_opened(text: str) -> int:
    body = text.lstrip()
    return int(body.startswith(("{", "<|python_tag|>")))


def llama3_constraint(tools: list[dict[str, Any]], one: bool) -> dict[str, Any]:
    return structural_tag({"type": "or", "elements": call_tags(tools, "", "parameters", "}")})


@register(
    "llama3_json", markers=("<|python_tag|>",), safe=_llama3_safe, constraint=llama3_constraint,
    opened=_llama3_opened,
)
def parse_llama3_json(text: str) -> tuple[str | None, Calls]:
    """The whole answer is the call(s); anything else is text."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _named(obj, "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments")
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return None, calls


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def _mistral_opened(text: str) -> int:
    return int("[TOOL_CALLS]" in text)


@register("mistral", markers=("[TOOL_CALLS]", "[ARGS]"), safe=before("[TOOL_CALLS]"),
          opened=_mistral_opened)
def parse_mistral(text: str) -> tuple[str | None, Calls]:
    """Text before [TOOL_CALLS] is content; after it a JSON list of calls, or name[ARGS]{...}."""
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    tail = tail.replace("[TOOL_CALLS]", "").strip()
    calls: Calls = []
    if tail.startswith("["):
        try:
            objs = json.loads(tail)
        except ValueError:
            return text, []
        calls = [c for c in map(_named, objs if isinstance(objs, list) else []) if c]
        if not calls or len(calls) != len(objs):
            return text, []
    else:
        decoder = json.JSONDecoder()
        at = 0
        while at < len(tail):
            m = _MISTRAL_NAMED.match(tail, at)
            if m is None:
                return text, []
            try:
                args, end = decoder.raw_decode(tail, m.end())
            except ValueError:
                return text, []
            calls.append(_call(m.group(1), args))
            at = end
            while at < len(tail) and tail[at].isspace():
                at += 1
        if not calls:
            return text, []
    content = head.rstrip()
    return content or None, calls


_DETECT = [("mistral", "[TOOL_CALLS]"), ("llama3_json", "<|python_tag|>"), ("hermes", "<tool_call>")]


def parser_for(name: str, chat_template: Any) -> Parser:
    """The parser `name`, or for "auto" the one whose marker the chat template writes."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"tool parser {name!r} is unknown; known: auto, {', '.join(PARSERS)}")
        return PARSERS[name]
    template = str(chat_template or "")
    for parser, marker in _DETECT:
        if marker in template:
            return PARSERS[parser]
    if '"parameters"' in template and "<|eot_id|>" in template:  # Llama 3 JSON without python_tag
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
