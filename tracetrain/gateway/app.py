"""The gateway app: `create_app(store, engines, admin_key=...)` -> a FastAPI app.

    app.state.gateway   the Gateway below: store, engine slots, keys, settings
    routes              rollout_routes (rollouts, rewards, events), openai_routes (per-rollout
                        OpenAI API), engine_routes (register, pause, resume, drain)
    fast_routes         the model routes, answered before the middleware stack (GatewayApp)
    limits              request bodies over max_body_bytes are refused (413) without being read
    errors              every error is a JSON body; no client mistake is a 5xx

Serve it with uvicorn (`tracetrain.gateway.serve`). The app does not own the store or the engines
it was given (the caller closes them); it closes the engines it built itself (registered ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import Receive, Scope, Send

from tracetrain.engines.base import Engine, EngineError
from tracetrain.gateway import (
    anthropic_routes,
    engine_routes,
    errors,
    fast_routes,
    openai_routes,
    responses_routes,
    rollout_routes,
)
from tracetrain.gateway.context import CONTEXT_POLICIES
from tracetrain.gateway.first_calls import RoleCalls
from tracetrain.gateway.limits import BodySizeLimit
from tracetrain.gateway.slots import EngineSlot
from tracetrain.gateway.tool_calls import PARSERS
from tracetrain.store import RolloutHead, Store

log = logging.getLogger("tracetrain.gateway")

EngineFactory = Callable[[dict[str, Any], "Gateway"], Engine]


@dataclass(kw_only=True)
class Gateway:
    store: Store
    admin_key: str
    default_engine: str
    pause_wait_s: float = 60.0
    public_url: str | None = None
    engine_factory: EngineFactory | None = None
    max_body_bytes: int = 8 << 20
    context: str = "exact"  # how chat prompts are built: exact | template (gateway/context.py)
    tool_parser: str = "auto"  # tool calls' format (gateway/tool_calls.py); auto: from the template
    forced_tool_choice: str = "refuse"  # a forced call it cannot enforce: refuse (400) | as_auto
    slots: dict[str, EngineSlot] = field(default_factory=dict)
    owned: list[Engine] = field(default_factory=list)  # engines this app built, closed on shutdown
    # role -> the engine (slot name) that serves its calls, whatever the rollout's engine (a role
    # that does not train, served by a frozen copy of the policy or an upstream model)
    role_engines: dict[str, str] = field(default_factory=dict)
    # several policies (config `policies`): role -> the adapter that makes its calls on the
    # policy's engine; a role not named: `base_adapter` (None: the engine's model as it is)
    role_adapters: dict[str, str] = field(default_factory=dict)
    base_adapter: str | None = None
    calls: RoleCalls = field(init=False)  # which roles of each rollout have called (first_calls.py)

    def __post_init__(self) -> None:
        self.calls = RoleCalls(self.store)

    def add_engine(self, name: str, engine: Engine, *, spec: dict | None = None) -> EngineSlot:
        missing = [
            a
            for a in ("tokenizer", "model_version", "max_context", "generate")
            if not hasattr(engine, a)
        ]
        if missing:
            raise TypeError(
                f"engine {name!r} lacks {', '.join(missing)} (see tracetrain.engines.base.Engine)"
            )
        self.slots[name] = EngineSlot(
            name, engine, pause_wait_s=self.pause_wait_s, spec=spec, tool_parser=self.tool_parser
        )
        if spec is not None:
            self.owned.append(engine)
        return self.slots[name]

    def warm(self) -> None:
        """Each slot's first-request work done now (EngineSlot.warm); a slot that fails it is
        left to fail on its requests, with their error."""
        for slot in self.slots.values():
            try:
                slot.warm()
            except Exception as e:
                log.warning("engine %r not warmed: %s: %s", slot.name, type(e).__name__, e)

    def serve_policies(self, role_policies: dict[str, str]) -> None:
        """Several policies: each role's calls by its policy's adapter, a role of none by the base."""
        from tracetrain.models.lora import BASE

        self.role_adapters.update(role_policies)
        self.base_adapter = BASE

    def adapter_for(self, role: str, slot: EngineSlot) -> str | None:
        """The adapter that makes `role`'s call on `slot` (role_adapters; the policy's engine only)."""
        if slot.name != self.default_engine:
            return None
        return self.role_adapters.get(role, self.base_adapter)

    def slot_for(self, rollout: RolloutHead, role: str | None = None) -> EngineSlot:
        """The engine of a call: its role's (role_engines), else the rollout's, else the default."""
        name = self.role_engines.get(role) if role is not None else None
        name = name or rollout.engine or self.default_engine
        slot = self.slots.get(name)
        if slot is None:
            raise EngineError(
                f"engine {name!r} of rollout {rollout.rollout_id!r} is not available", 503
            )
        return slot

    def base_url(self, request: Request, rollout_id: str) -> str:
        root = self.public_url or str(request.base_url)
        return f"{root.rstrip('/')}/rollouts/{rollout_id}/v1"


class GatewayApp(FastAPI):
    """FastAPI, except that a POST to a model route goes to fast_routes.serve first."""

    gateway: Gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = fast_routes.MODEL_ROUTE.fullmatch(scope["path"])
            if match is not None:
                return await fast_routes.serve(self.gateway, match, scope, receive, send)
        await super().__call__(scope, receive, send)


def create_app(
    store: Store,
    engines: Engine | Mapping[str, Engine],
    *,
    admin_key: str,
    max_body_bytes: int = 8 << 20,
    pause_wait_s: float = 60.0,
    default_engine: str | None = None,
    public_url: str | None = None,
    engine_factory: EngineFactory | None = None,
    close_engines: bool = False,
    context: str = "exact",
    tool_parser: str = "auto",
    forced_tool_choice: str = "refuse",
) -> FastAPI:
    """Build the gateway. `engines`: one engine (named "default") or {name: engine}; the default
    engine serves rollouts that name none. `engine_factory(spec, gateway)` builds engines registered
    over HTTP (and rebuilds persisted ones at startup); without it registration is refused.
    close_engines: also close the given engines at shutdown (the app then owns them).
    context: "exact" (a turn's prompt continues the ids of the turn it follows) or "template" (the
    chat template's full render every time); gateway/context.py. tool_parser: the format of the
    model's tool calls, "auto" (detected from the chat template), "off" (auto, and never the tool
    block) or a name in tool_calls.PARSERS; a template that drops tools gets them written into the
    messages (slots.ToolFormat).
    forced_tool_choice: what a tool_choice that forces a call gets where it cannot be enforced
    (an engine that cannot constrain decoding, a tool parser without a constraint; see
    render.decoding): "refuse" (400) or "as_auto" (generated as auto; smolagents'
    ToolCallingAgent sends "required")."""
    if not isinstance(admin_key, str) or not admin_key.strip():
        raise ValueError("admin_key must be a non-empty string")
    if (
        isinstance(max_body_bytes, bool)
        or not isinstance(max_body_bytes, int)
        or max_body_bytes < 1
    ):
        raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
    if tool_parser not in ("auto", "off") and tool_parser not in PARSERS:
        raise ValueError(
            f"tool_parser must be auto, off or one of {', '.join(PARSERS)}, got {tool_parser!r}"
        )
    if forced_tool_choice not in ("refuse", "as_auto"):
        raise ValueError(f"forced_tool_choice must be refuse or as_auto, got {forced_tool_choice!r}")
    if context not in CONTEXT_POLICIES:
        raise ValueError(f"context must be one of {', '.join(CONTEXT_POLICIES)}, got {context!r}")
    engines = {"default": engines} if not isinstance(engines, Mapping) else dict(engines)
    if not engines:
        raise ValueError("engines is empty; the gateway needs at least one engine")
    default_engine = default_engine or next(iter(engines))
    if default_engine not in engines:
        raise ValueError(
            f"default_engine {default_engine!r} is not among the engines {sorted(engines)}"
        )
    gw = Gateway(store=store, admin_key=admin_key, default_engine=default_engine,
                 pause_wait_s=pause_wait_s, public_url=public_url, engine_factory=engine_factory,
                 max_body_bytes=max_body_bytes, context=context, tool_parser=tool_parser,
                 forced_tool_choice=forced_tool_choice)
    for name, engine in engines.items():
        gw.add_engine(name, engine)
        if close_engines:
            gw.owned.append(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_factory is not None:  # engines registered before a restart
            for name, spec in store.list_engines().items():
                if name in gw.slots:
                    continue
                try:
                    gw.add_engine(name, engine_factory(spec, gw), spec=spec)
                except Exception as e:
                    log.warning("engine %r not rebuilt: %s: %s", name, type(e).__name__, e)
        gw.warm()
        yield
        for engine in gw.owned:
            await engine.aclose()

    app = GatewayApp(
        title="tracetrain gateway",
        version="1",
        description="OpenAI-compatible endpoint per rollout that records exact token ids.",
        lifespan=lifespan,
    )
    app.state.gateway = app.gateway = gw
    errors.install(app)
    app.include_router(rollout_routes.router)
    openai_routes.install(
        app, [*openai_routes.HOT_ROUTES, responses_routes.ROUTE, anthropic_routes.ROUTE]
    )
    app.include_router(engine_routes.router)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)

    @app.get("/health", tags=["health"])
    async def health() -> dict:
        return {"ok": True}

    return app
