"""An engine slot: the gate in front of one engine, for weight updates.

    pause()   new requests wait at the gate (at most `pause_wait_s`, then 503) instead of failing
    resume()  open the gate
    drain()   pause, then wait until the requests already past the gate have finished (their
              turns recorded)

A weight update is `await slot.drain(); update weights; slot.resume()`. Methods run on the
gateway's event loop (from another thread use the HTTP routes). `slot.prompts` encodes rendered
prompts for this engine's tokenizer (prompt_cache.PromptEncoder) and `slot.exact` builds exact
prompts from earlier turns (context.ExactContext); both are built on first use, and again when the
engine's tokenizer changes.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any

from tracetrain.engines.base import Engine, EngineError
from tracetrain.gateway.context import ExactContext
from tracetrain.gateway.prompt_cache import PromptEncoder
from tracetrain.gateway.render import template_text
from tracetrain.gateway.tool_calls import Parser, parser_for


class EngineSlot:
    def __init__(
        self, name: str, engine: Engine, *, pause_wait_s: float = 60.0, spec: dict | None = None
    ):
        self.name, self.engine, self.pause_wait_s = name, engine, pause_wait_s
        self.spec = spec  # how it was registered (None for engines given at startup)
        self.in_flight = 0
        self.served = 0
        self._busy_s, self._busy_since = 0.0, 0.0  # time with a request in flight (busy_seconds)
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._prompts: PromptEncoder | None = None
        self._exact: ExactContext | None = None
        self._parser: tuple[Any, str, Parser] | None = None  # (template, asked, parser)

    @property
    def prompts(self) -> PromptEncoder:
        if self._prompts is None or self._prompts.tokenizer is not self.engine.tokenizer:
            self._prompts = PromptEncoder(self.engine.tokenizer)
        return self._prompts

    @property
    def exact(self) -> ExactContext:
        prompts = self.prompts
        if self._exact is None or self._exact.prompts is not prompts:
            tok = prompts.tokenizer
            self._exact = ExactContext(prompts, lambda m, t, g: template_text(tok, m, t, g))
        return self._exact

    def warm(self, tool_parser: str) -> None:
        """Build now what a first chat request would build (the prompt encoder's check of where
        prompts split, the exact context's probes, the tool parser, the compiled template): on a
        large vocabulary ~0.1 s that is then not that request's latency."""
        self.tool_parser(tool_parser)
        if getattr(self.engine.tokenizer, "chat_template", None) is not None:
            self.exact.warm()

    def tool_parser(self, name: str) -> Parser:
        """The tool-call parser `name` ("auto": detected from the engine's chat template)."""
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if self._parser is None or self._parser[:2] != (template, name):
            self._parser = (template, name, parser_for(name, template))
        return self._parser[2]

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def drain(self, timeout: float) -> bool:
        """Pause, then wait (at most `timeout` s) for in-flight requests; True when none is left."""
        self.pause()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @asynccontextmanager
    async def admit(self):
        """Hold a place among the in-flight requests while generating; wait while paused."""
        deadline = time.monotonic() + self.pause_wait_s
        while not self._open.is_set():  # re-check: a pause may follow the resume that woke us
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._open.wait(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise EngineError(
                    f"engine {self.name!r} is paused (waited {self.pause_wait_s:g} s)", status=503
                ) from None
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield self.engine
        finally:
            self.in_flight -= 1
            self.served += 1
            if self.in_flight == 0:
                self._busy_s += time.monotonic() - self._busy_since
                self._idle.set()

    def busy_seconds(self) -> float:
        """Seconds so far with at least one request admitted and not answered (the engine had
        work); its complement over a span of wall time is the engine's idle time."""
        return self._busy_s + (time.monotonic() - self._busy_since if self.in_flight else 0.0)

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {
            "name": self.name,
            "kind": getattr(e, "name", type(e).__name__),
            "model_version": e.model_version,
            "max_context": e.max_context,
            "paused": self.paused,
            "in_flight": self.in_flight,
            "served": self.served,
            "spec": self.spec,
        }
