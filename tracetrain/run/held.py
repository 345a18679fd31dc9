"""An engine held while its weights change: new requests wait, those in flight finish first."""

from __future__ import annotations

import contextlib
import logging

from tracetrain.agents.runner import GatewayClient
from tracetrain.gateway.slots import EngineSlot

log = logging.getLogger("tracetrain.trainer")


@contextlib.asynccontextmanager
async def held_engine(gateway: GatewayClient, slot: EngineSlot | None = None, name: str = "default",
                      drain_timeout_s: float = 60.0):
    """The engine with new requests held and none in flight (drain), resumed on exit: the window
    in which its weights may change. `slot`: the engine's slot when the gateway runs in this
    event loop (the trainer's own), held directly instead of through the admin routes."""
    if slot is None:
        await gateway.drain(name, drain_timeout_s)
    else:
        while not await slot.drain(drain_timeout_s):
            log.warning("engine %r: %d requests still in flight after %g s; waiting on",
                        slot.name, slot.in_flight, drain_timeout_s)
    try:
        yield
    finally:
        if slot is None:
            await gateway.engine(name, "resume")
        else:
            slot.resume()
