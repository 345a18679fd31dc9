"""An engine slot: the gate in front of one engine, for weight updates.

    pause()   new requests wait at the gate (at most `pause_wait_s`, then 503) instead of failing
    resume()  open the gate
    drain()   pause, then wait until the requests already past the gate have finished (their
              turns recorded)

A weight update is `await slot.drain(); update weights; slot.resume()`. Methods run on the
gateway's event loop (from another thread use the HTTP routes). `slot.prompts` encodes rendered
prompts for this engine's tokenizer (prompt_cache.PromptEncoder) and `slot.exact` builds exact
prompts from earlier turns (context.ExactContext); both are built on first use, and again when the
engine's tokenizer changes. `slot.tools` is how tools reach this engine's model and how its calls
are read (ToolFormat), for the gateway's `tool_parser` and the engine's chat template.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tracetrain.engines.base import Engine, EngineError
from tracetrain.gateway.context import ExactContext
from tracetrain.gateway.prompt_cache import PromptEncoder
from tracetrain.gateway.render import template_text
from tracetrain.gateway.tool_calls import Parser, parser_for
from tracetrain.models.tool_prompt import BLOCK_SETTINGS, TOOL_FORMAT, drops_tools

log = logging.getLogger("tracetrain.gateway")


@dataclass(frozen=True)
class ToolFormat:
    """How tools reach one engine's model: `parser` reads its calls; `inject` true: its chat
    template drops tools, so the gateway writes them into the messages (models/tool_prompt.py).

    tool_parser  auto           the parser whose markers the template writes; where the template
                                drops tools, the tool block is written in and calls read as hermes
                 hermes         calls read as hermes; the block written in where the template drops
                                tools
                 llama3_json,   that format's calls; never the block (it is hermes): a template that
                 mistral        drops tools is logged
                 off            the parser as auto picks it; never the block
    """

    parser: Parser
    inject: bool

    @classmethod
    def of(cls, name: str, tokenizer: Any, engine: str) -> ToolFormat:
        template = getattr(tokenizer, "chat_template", None)
        dropped = template is not None and drops_tools(tokenizer)
        inject = dropped and name in BLOCK_SETTINGS  # (tool_prompt.writes_block, computed once)
        parser = parser_for(TOOL_FORMAT if inject else ("auto" if name == "off" else name), template)
        if inject:
            log.info("engine %r: its chat template does not render tools; the gateway writes them "
                     "into the system message and reads calls as %s (gateway.tool_parser %s)",
                     engine, TOOL_FORMAT, name)
        elif dropped:
            log.warning("engine %r: its chat template does not render tools, and gateway.tool_parser "
                        "is %s: requests' tools do not reach the model", engine, name)
        return cls(parser, inject)


class EngineSlot:
    def __init__(
        self, name: str, engine: Engine, *, pause_wait_s: float = 60.0, spec: dict | None = None,
        tool_parser: str = "auto",
    ):
        self.name, self.engine, self.pause_wait_s = name, engine, pause_wait_s
        self.tool_parser = tool_parser  # gateway.tool_parser (ToolFormat)
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
        self._tools: tuple[Any, ToolFormat] | None = None  # (the template it is for, it)

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
            self._exact = ExactContext(
                prompts, lambda m, t, g: template_text(tok, m, t, g, self.tools.inject)
            )
        return self._exact

    def warm(self) -> None:
        """Build now what a first chat request would build (the prompt encoder's check of where
        prompts split, the exact context's probes, the tool format, the compiled template): on a
        large vocabulary ~0.1 s that is then not that request's latency."""
        _ = self.tools
        if getattr(self.engine.tokenizer, "chat_template", None) is not None:
            self.exact.warm()

    @property
    def tools(self) -> ToolFormat:
        """The tool format for the engine's chat template (again when the template changes)."""
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if self._tools is None or self._tools[0] != template:
            self._tools = (template, ToolFormat.of(self.tool_parser, self.engine.tokenizer, self.name))
        return self._tools[1]

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
