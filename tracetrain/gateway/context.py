"""Exact context: a turn's prompt continues the token ids of the turn before it.

A multi-turn agent sends its whole history on every call. Under `context: exact` (the default)
the gateway does not re-render that history; it finds the latest earlier turn j of the rollout
whose conversation is a prefix of the request's messages and builds

    prompt = prompt_ids(j) + response_ids(j) + encode(rest + delta)

    conversation(j)  the messages turn j was sent, then the assistant message the gateway answered
                     it with. Compared with the request semantically (`answer_key`): an assistant
                     message by its text (None == "", outer whitespace ignored) and its tool calls
                     (name, and arguments as parsed JSON, so spacing, key order and string-or-object
                     do not matter; call ids are ignored); any other message by value.
    delta            the template's own rendering of the new messages at that position:
                         longer  = render(base + new, add_generation_prompt=True)
                         shorter = render(base)
                         delta   = longer[len(shorter):]     used only if shorter is a prefix
                     where base is the history cut to what the new messages' rendering can depend
                     on (`_base`).
    rest             what the template writes after an assistant message (its closing, ChatML's
                     "<|im_end|>\\n"), less the tokens the response already ends with: the "\\n"
                     after an <|im_end|> the model generated; all of it after a cut-off response.

The model is then trained on the ids it saw: nothing it generated is decoded, re-serialized or
re-tokenized, and earlier reasoning stays even where the template would drop it. When no earlier
turn matches, or the template fails the prefix check, the prompt is the template's full render and
the turn records why (types.REASONS): the first call of its role in the rollout (first_turn: a
rollout's first call, or a checker's first call after the solver's turns); earlier calls of its
role exist but none is held here (forgotten); some are held but none is a prefix (no_match: the
harness truncated, summarised or edited its history); template_prefix. Under `context: template`
every prompt is the full render.

Which earlier turn: the latest one of the calling role whose conversation is a prefix, else the
latest one of another role (a role's first call may extend another role's conversation). So roles
that alternate on one engine each continue their own turns: a role whose history also extends
another role's turn (the same opening, an answer of the same text with other ids) still continues
its own ids, which its row chains on (rows/roles.py).

Memory: the last KEEP answered turns of each role of each rollout on this engine (their messages,
answer, ids), so one role's calls never evict another's; in an LRU over rollouts bounded by
`max_bytes`. A gateway restart forgets them: the next turn of a rollout that was running renders
in full (reason "forgotten"). Whether a call is its role's first is the caller's to say
(first_calls.RoleCalls): a role served by another engine has its first call where this memory
holds nothing of the rollout.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tracetrain.gateway.jsonbytes import dumps
from tracetrain.gateway.prompt_cache import PromptEncoder
from tracetrain.types import (
    DEFAULT_ROLE,
    EXACT,
    FIRST_TURN,
    FORGOTTEN,
    NO_MATCH,
    RENDERED,
    TEMPLATE_PREFIX,
)

CONTEXT_POLICIES = ("exact", "template")

KEEP = 8  # answered turns remembered per role of a rollout
_PLACEHOLDER = "…"  # stands for the answered message's text in the base (see _base)
_PROBE = "\x00tracetrain-probe\x00"
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True, slots=True)
class Built:
    """A chat prompt and how it was built (recorded with the turn)."""

    prompt_ids: list[int]
    context: str  # EXACT | RENDERED
    reason: str | None  # for RENDERED: one of REASONS
    reused_tokens: int  # prompt ids taken as they were from the earlier turn (not rendered)
    ids: array | None = None  # prompt_ids as an int32 array, when built from one
    from_turn: int | None = None  # for EXACT: the index of that earlier turn
    n_kept: int = 0  # for EXACT: leading messages that were that turn's (its messages + answer)


@dataclass(slots=True)
class _Answered:
    """One answered turn of a role: what it was sent, what it answered, its ids. Kept as bytes,
    arrays and tuples of atoms, which the garbage collector does not traverse: holding the
    messages as dicts made its full collections cost more than building the prompts."""

    sent: bytes  # the JSON of the messages the turn was sent
    n_sent: int
    answer: tuple  # answer_key of the assistant message it answered with
    tools: bytes  # the JSON of the tools it was sent
    ids: array  # prompt_ids + response_ids
    response_tail: tuple[int, ...]
    turn: int  # its index in the rollout

    @property
    def size(self) -> int:  # bytes, roughly
        return len(self.sent) + len(self.tools) + 4 * len(self.ids) + 300


# ------------------------------------------------------------------------- comparing messages


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text") or "" for p in content)
    return dumps(content).decode()


def _arguments(args: Any) -> bytes:
    """Tool-call arguments, canonical: parsed JSON re-dumped with sorted keys; text that is not
    JSON stays text."""
    if isinstance(args, str):
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return b"text:" + args.strip().encode()
    try:
        return dumps(args, sort_keys=True)
    except TypeError:
        return b"repr:" + repr(args).encode()


def answer_key(message: dict) -> tuple:
    """An assistant message as the gateway compares it: (text stripped, ((name, arguments), ...))."""
    calls = []
    for call in message.get("tool_calls") or ():
        f = call.get("function", call) if isinstance(call, dict) else {}
        f = f if isinstance(f, dict) else {}
        calls.append((f.get("name"), _arguments(f.get("arguments"))))
    return (_text(message.get("content")).strip(), tuple(calls))


def _same(a: dict, b: dict) -> bool:
    """Two messages of one history are the same: assistant messages by answer_key, others by value
    (None-valued keys ignored)."""
    if a == b:
        return True
    if a.get("role") != b.get("role"):
        return False
    if a.get("role") == "assistant":
        return answer_key(a) == answer_key(b)
    return {k: v for k, v in a.items() if v is not None} == {k: v for k, v in b.items() if v is not None}


def messages_json(messages: list[dict]) -> bytes | None:
    """The messages' JSON, as build and answered compare and keep it (None: not JSON)."""
    return _json(messages)


def _json(value: Any) -> bytes | None:
    try:
        return dumps(value)
    except TypeError:  # not JSON at all (an object no encoder writes): never matched
        return None


def _continues(entry: _Answered, messages: list[dict], sent: bytes | None, tools: bytes) -> bool:
    """entry's conversation (its messages, then its answer) is a prefix of `messages` (whose JSON
    is `sent`): the same JSON (the harness resent its history unchanged: `sent` begins with
    entry.sent's messages and a comma), or else the same messages by `_same`."""
    n = entry.n_sent
    if len(messages) <= n or entry.tools != tools:
        return False
    if messages[n].get("role") != "assistant" or answer_key(messages[n]) != entry.answer:
        return False
    head = entry.sent[:-1] + b","  # "[m0,...,m(n-1)," : JSON values delimit themselves
    if sent is not None and sent.startswith(head):
        return True
    return all(map(_same, messages[:n], orjson.loads(entry.sent)))


# ------------------------------------------------------------------------- the template's part


def _base(history: list[dict]) -> list[dict]:
    """The history cut to what the rendering of messages after it can depend on: the first message
    if it is a system one (tools and defaults are rendered around it), the last user message, and
    the answered assistant message with its text replaced and its reasoning removed (its tool
    calls kept: a template may pair results with calls). So a template that rewrites earlier
    assistant turns (drops their reasoning once a new user message follows) renders the base alike
    with and without the new messages."""
    answered = {k: v for k, v in history[-1].items() if k not in _REASONING_KEYS}
    if _text(answered.get("content")):
        answered["content"] = _PLACEHOLDER
    base = []
    if len(history) > 1 and history[0].get("role") in ("system", "developer"):
        base.append(history[0])
    for m in reversed(history[1 if base else 0 : -1]):
        if m.get("role") == "user":
            base.append(m)
            break
    base.append(answered)
    return base


class ExactContext:
    """Exact prompts for one engine's tokenizer (module docstring). Not thread-safe: one per
    event loop.

    build(rollout_id, messages, tools, full, first, sent, role)   -> Built
    answered(rollout_id, turn, messages, tools, answer, prompt_ids, response_ids, sent, role)
                                                                        remember turn `turn`

    `prompts` encodes for the engine's tokenizer; `render(messages, tools, generation_prompt)` is
    the chat template's text.
    """

    def __init__(
        self,
        prompts: PromptEncoder,
        render: Callable[[list[dict], list | None, bool], str],
        *,
        max_bytes: int = 64 << 20,
    ):
        self.prompts, self.render = prompts, render
        self.tokenizer = prompts.tokenizer
        self.max_bytes = max_bytes
        # rollout -> role -> its last KEEP answered turns, oldest first
        self._rollouts: OrderedDict[str, dict[str, list[_Answered]]] = OrderedDict()
        self._bytes = 0
        self._closings: dict[tuple[Any, bool], tuple[str, list[int]] | None] = {}

    # -- building a prompt

    def build(
        self,
        rollout_id: str,
        messages: list[dict],
        tools: list | None,
        full: Callable[[], list[int]],
        *,
        first: bool,
        sent: bytes | None,
        role: str = DEFAULT_ROLE,
    ) -> Built:
        """The prompt of a chat request under `context: exact`. `full()`: the template's full render
        (ids); `first`: `role`, which makes the call, has made no chat call in the rollout yet;
        `sent`: `messages_json(messages)`. The turn continued is `role`'s own latest that matches,
        else another role's latest that matches."""
        roles = self._rollouts.get(rollout_id) or {}
        entry = None
        if roles:
            self._rollouts.move_to_end(rollout_id)
            tools_json = _json(tools)
            own = roles.get(role, ())
            others = sorted((e for r, held in roles.items() if r != role for e in held),
                            key=lambda e: e.turn)
            entry = next((e for held in (own, others) for e in reversed(held)
                          if _continues(e, messages, sent, tools_json)), None)
        if entry is None:
            if first:
                why = FIRST_TURN
            elif role in roles:
                why = NO_MATCH
            else:  # its role's earlier turns: before a restart, evicted, or on another engine
                why = FORGOTTEN
            return Built(full(), RENDERED, why, 0)
        suffix = self._suffix(messages, entry.n_sent + 1, tools, entry.response_tail)
        if suffix is None:
            return Built(full(), RENDERED, TEMPLATE_PREFIX, 0)
        ids = entry.ids + array("i", self.prompts.encode(suffix))
        return Built(ids.tolist(), EXACT, None, len(entry.ids), ids, entry.turn, entry.n_sent + 1)

    def warm(self) -> None:
        """Probe the template's closing with and without tools now, not on a first request."""
        self._closing(None)
        self._closing([{"type": "function", "function": {"name": "probe", "parameters": {}}}])

    def _closing(self, tools: list | None) -> tuple[str, list[int]] | None:
        """(text, ids) the template writes after an assistant message's content; None if a probe
        conversation does not show it."""
        key = (getattr(self.tokenizer, "chat_template", None), bool(tools))
        if key not in self._closings:
            probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
            try:
                text = self.render(probe, tools, False)
            except Exception:  # a template that refuses the probe: no exact context with it
                text = ""
            at = text.rfind(_PROBE)
            closing = text[at + len(_PROBE) :] if at >= 0 else None
            self._closings[key] = (
                None if closing is None else (closing, self.prompts.encode(closing))
            )
        return self._closings[key]

    def _suffix(
        self, messages: list[dict], n: int, tools: list | None, response_tail: Sequence[int]
    ) -> str | None:
        """rest + delta for the messages after messages[:n] (module docstring); None when the
        template fails the prefix check."""
        closing = self._closing(tools)
        if closing is None:
            return None
        closing_text, closing_ids = closing
        base = _base(messages[:n])
        try:
            shorter = self.render(base, tools, False)
            longer = self.render(base + messages[n:], tools, True)
        except Exception:  # the full render will say what is wrong (a 400) or succeed
            return None
        if not longer.startswith(shorter) or not shorter.endswith(closing_text):
            return None
        rest = closing_text
        for t in range(min(len(closing_ids), len(response_tail)), 0, -1):
            if list(response_tail[-t:]) == closing_ids[:t]:
                done = self.tokenizer.decode(closing_ids[:t], skip_special_tokens=False)
                if closing_text.startswith(done):
                    rest = closing_text[len(done) :]
                break
        return rest + longer[len(shorter) :]

    # -- remembering answered turns

    def answered(
        self,
        rollout_id: str,
        turn: int,
        messages: list[dict],
        tools: list | None,
        answer: dict,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        sent: bytes | None,
        role: str = DEFAULT_ROLE,
    ) -> None:
        """Remember turn `turn`, made by `role`; `sent`: `messages_json(messages)` (None: not JSON,
        not kept)."""
        tools_json = _json(tools)
        if sent is None or tools_json is None:
            return
        prompt = prompt_ids if isinstance(prompt_ids, array) else array("i", prompt_ids)
        entry = _Answered(
            sent, len(messages), answer_key(answer), tools_json,
            prompt + array("i", response_ids), tuple(response_ids[-8:]), turn,
        )
        if entry.size > self.max_bytes // 8:
            return
        held = self._rollouts.setdefault(rollout_id, {}).setdefault(role, [])
        self._rollouts.move_to_end(rollout_id)
        held.append(entry)
        self._bytes += entry.size
        if len(held) > KEEP:
            self._bytes -= held.pop(0).size
        while self._bytes > self.max_bytes and self._rollouts:
            _, old = self._rollouts.popitem(last=False)
            self._bytes -= sum(e.size for turns in old.values() for e in turns)
