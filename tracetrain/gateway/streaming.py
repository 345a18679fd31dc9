"""Real token streaming: a turn's text goes to the client as the engine makes its tokens.

    LiveTurn     runs one chat-shaped turn (turn.chat_answer) as a task; the engine's
                 `on_tokens` feeds `TextDeltas`, whose deltas the route sends as its API's events
    TextDeltas   response ids so far -> the text that is certainly the start of the answer's final
                 content, never more
    EventStream  the ASGI response: the events as they come; the client leaving cancels the turn

What may be sent after ids y_1..y_k (TextDeltas.add):

    text   the decoded ids, less a trailing stop id, special tokens left out but a tool parser's
           markers (as the final answer is decoded: turn.final_text), decoded incrementally
    end    at the first stop string in text; else before the longest tail of text that begins one
    end    before a trailing U+FFFD (a UTF-8 character cut between tokens) and trailing whitespace
           (a parser strips it before a tool call; a decoder may rewrite it once the next token
           arrives)
    end    parser.safe(text[:end]) with tools offered: before anything that may begin a tool call
    sent   text[:end], when text still starts with what was sent

At the end the answer is decoded and parsed whole, exactly as when not streaming; the route sends
its content's rest (content[len(sent):]) and its tool calls, once parsed, as the API's tool-call
deltas. The turn is recorded before the last event. A client that leaves mid-stream cancels the
turn's task: the engine stops decoding it and no turn is recorded (or, if it left after the
generation ended, the whole turn is).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tracetrain.engines.base import SamplingParams
from tracetrain.gateway.render import answer_text

log = logging.getLogger("tracetrain.gateway")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _stop_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if s.startswith(text[-n:]):
                longest = n
                break
    return longest


class TextDeltas:
    """The text deltas of one generating answer (module docstring). `start` before the first
    token; `add` is the engine's on_tokens; `rest(content)` what is left to send at the end."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()  # None: the turn ended
        self.sent = ""
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:self._read]
        self._prefix = self._read = 0
        self._open = False  # start() called: tokens are expected
        self._stopped = False  # the decoded text stopped extending what was sent

    def start(self, tokenizer: Any, params: SamplingParams, markers: tuple[str, ...],
              safe: Callable[[str], int] | None, prompt_tokens: int) -> None:
        """`markers`: the tool parser's markers to keep in the text (none: every special token
        left out); `safe`: the parser's safe(text) when tool calls are parsed; `prompt_tokens`:
        the prompt's length (Anthropic's first event tells it)."""
        self.tokenizer, self.params, self.markers, self.safe = tokenizer, params, markers, safe
        self.prompt_tokens = prompt_tokens
        self._open = True

    def _decode(self, ids: list[int]) -> str:
        return answer_text(self.tokenizer, ids, self.markers)

    def add(self, new_ids: list[int]) -> None:
        """The engine made `new_ids`: queue the text that may now be sent."""
        if not self._open or self._stopped:
            return
        self.ids += new_ids
        ids = self.ids
        if ids and ids[-1] in self.params.stop_token_ids:
            ids = ids[:-1]
        if len(ids) > self._read:  # incremental decoding over a window that starts a few ids back
            before = self._decode(ids[self._prefix : self._read])
            after = self._decode(ids[self._prefix :])
            if after.startswith(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self._prefix, self._read = max(self._read - 4, 0), len(ids)
        text, stops = self.text, self.params.stop
        end = len(text)
        if stops:
            found = [at for at in (text.find(s) for s in stops) if at >= 0]
            end = min(found) if found else end - _stop_tail(text, stops)
        end = len(text[:end].rstrip().rstrip("\ufffd"))
        if self.safe is not None:
            end = min(end, self.safe(text[:end]))
        if end <= len(self.sent):
            return
        if not text.startswith(self.sent):
            self._stopped = True
            return
        delta, self.sent = text[len(self.sent) : end], text[:end]
        self.queue.put_nowait(delta)

    def rest(self, content: str | None) -> str:
        """What is left of the final content after the text sent (the final content is the
        whole answer: if it does not start with the text sent, which the rules above exclude
        but for a tokenizer whose decoding rewrites earlier text, it is logged)."""
        content = content or ""
        if content.startswith(self.sent):
            return content[len(self.sent) :]
        log.warning("streamed text %r is not the start of the answer %r", self.sent, content)
        return ""


_END = None  # queued when the turn's task ends


class LiveTurn:
    """One turn generating in a task while its text streams (module docstring)."""

    def __init__(self, answer: Callable[[TextDeltas], Any]):
        """`answer(deltas)`: the coroutine that makes and records the turn, feeding `deltas`."""
        self.deltas = TextDeltas()
        self.task = asyncio.ensure_future(answer(self.deltas))
        self.task.add_done_callback(lambda _: self.deltas.queue.put_nowait(_END))
        self._first: str | None = None

    async def opened(self) -> None:
        """Wait for the first text or the end of the turn: a turn that fails before any token
        (bad input, a prompt too long, the engine down) raises here, before a 200 is sent."""
        try:
            self._first = await self.deltas.queue.get()
        except asyncio.CancelledError:
            self.task.cancel()
            raise
        if self._first is _END:
            self.task.result()  # raises the turn's error

    async def text(self) -> AsyncIterator[str]:
        """The text deltas until the turn ends; those that queued up while the client was being
        written to go as one."""
        queue, delta = self.deltas.queue, self._first
        while delta is not _END:
            parts, ended = [delta], False
            while not queue.empty() and not ended:
                nxt = queue.get_nowait()
                ended = nxt is _END
                if not ended:
                    parts.append(nxt)
            yield "".join(parts)
            if ended:
                return
            delta = await queue.get()

    def cancel(self) -> None:
        self.task.cancel()


class EventStream(Response):
    """ASGI response: server-sent events from `events` (bytes each) as they come. The client
    leaving (http.disconnect, or a send that fails) stops it and calls `on_disconnect`.
    (Starlette's StreamingResponse, under ASGI 2.4 servers, notices a client that left only at
    its next send: a turn still in its prefill would decode on for nobody.)"""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.status_code, self.background = 200, None
        self.raw_headers = list(_HEADERS)
        self.events, self.on_disconnect = events, on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not writer.done():  # the client left first
                writer.cancel()
                self.on_disconnect()
        try:
            await writer
        except (asyncio.CancelledError, OSError):
            self.on_disconnect()

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
