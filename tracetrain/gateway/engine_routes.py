"""Engine routes (admin): list engines, register an upstream, pause / resume / drain one.

Registering builds the engine with the gateway's `engine_factory(spec, gateway)` (the serve
command's builds an UpstreamEngine) and persists the spec in the store, so a restarted gateway
rebuilds it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request

from tracetrain.gateway.errors import ApiError
from tracetrain.gateway.keys import require_admin
from tracetrain.gateway.schemas.base import ID_PATTERN
from tracetrain.gateway.schemas.engines import DrainOut, EngineOut, EnginesOut, RegisterEngineIn
from tracetrain.gateway.slots import EngineSlot

router = APIRouter(tags=["engines"], dependencies=[Depends(require_admin)])
EngineName = Annotated[str, Path(min_length=1, max_length=200, pattern=ID_PATTERN)]


def _slot(request: Request, name: str) -> EngineSlot:
    slots = request.app.state.gateway.slots
    if name not in slots:
        raise ApiError(404, f"engine {name!r} does not exist; engines: {', '.join(sorted(slots))}")
    return slots[name]


@router.get("/engines", response_model=EnginesOut)
async def list_engines(request: Request):
    return {"engines": [s.describe() for s in request.app.state.gateway.slots.values()]}


@router.post("/engines", response_model=EngineOut)
async def register_engine(body: RegisterEngineIn, request: Request):
    """Register an OpenAI-compatible upstream (vLLM / SGLang) under a new name."""
    gw = request.app.state.gateway
    if body.name in gw.slots:
        raise ApiError(409, f"engine {body.name!r} already exists", "name")
    if gw.engine_factory is None:
        raise ApiError(
            400, "this gateway was started without an engine factory; it cannot register engines"
        )
    spec = body.model_dump()
    try:
        engine = await asyncio.to_thread(gw.engine_factory, spec, gw)
    except Exception as e:
        raise ApiError(400, f"cannot build engine {body.name!r}: {type(e).__name__}: {e}") from e
    if body.name in gw.slots:  # registered by a concurrent request meanwhile
        await engine.aclose()
        raise ApiError(409, f"engine {body.name!r} already exists", "name")
    await gw.store.put_engine(body.name, spec)
    gw.add_engine(body.name, engine, spec=spec)
    gw.warm()
    return gw.slots[body.name].describe()


@router.post("/engines/{name}/pause", response_model=EngineOut)
async def pause(name: EngineName, request: Request):
    """New requests wait (bounded by the gateway's pause_wait_s, then 503) until resume."""
    slot = _slot(request, name)
    slot.pause()
    return slot.describe()


@router.post("/engines/{name}/resume", response_model=EngineOut)
async def resume(name: EngineName, request: Request):
    slot = _slot(request, name)
    slot.resume()
    return slot.describe()


@router.post("/engines/{name}/drain", response_model=DrainOut)
async def drain(
    name: EngineName, request: Request, timeout_s: Annotated[float, Query(ge=0, le=3600)] = 60.0
):
    """Pause, then wait until in-flight requests finish (drained=false if timeout_s passed first).
    Resume after the weight update."""
    slot = _slot(request, name)
    drained = await slot.drain(timeout_s)
    return {"drained": drained, "in_flight": slot.in_flight}
