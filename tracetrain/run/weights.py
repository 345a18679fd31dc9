"""How the policy's new weights reach the engine that samples the rollouts (one per run).

    shared    the engine decodes with the policy module itself (the local engine, given the
              policy): the update changes the weights in place inside a held window (new requests
              wait, none in flight), and the version bump is the whole sync.
    own copy  the engine keeps weights of its own: a local copy (trainer.collect overlap, or
              continuous collection ahead of the update: one version behind while the update
              runs) or a vLLM server's. `push` copies the policy's in, in a held window: right
              after each update when collection waits for it, else between two collects.
    asleep    engine.sleep_level (vLLM on the trainer's GPU): the server sleeps through the update.
    whole     several policies: each whole-model policy's local engine decodes with its model
              itself (shared), held and bumped with the policy's engine.

`engine_model` (the engine's copy, or the CPU mirror of a server's) and `engine_version` (the
version of the weights the engine holds) are what a checkpoint keeps of the engine
(run/checkpoint.py); `next_weights` replaces them there when the last step's eval made the engine
leave the weights the next step's rollouts come from.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from tracetrain.agents.runner import GatewayClient
from tracetrain.gateway.slots import EngineSlot
from tracetrain.models import lora
from tracetrain.run.held import held_engine


class WeightSync:
    """The engine's weights: which they are, their version, and how new ones get there."""

    def __init__(self, model: torch.nn.Module, *, own_copy: bool, sleep_level: int = 0):
        self.model = model  # the policy (not its DDP wrapper)
        self.own_copy, self.sleep_level = own_copy, sleep_level
        self.engine_model: torch.nn.Module | None = None  # own_copy: the engine's weights, kept
        self.engine_version = 0
        self.next_weights: dict | None = None
        self.engine: Any = None
        self.slot: EngineSlot | None = None
        self.mirror = False
        self.whole: list[tuple[Any, EngineSlot]] = []  # (engine, slot) of whole-model policies

    def drop_prefix_caches(self) -> None:
        """The local engines forget the prompt prefixes they kept (an eval pass's): a step's
        collect then starts from the empty cache a resumed run's engine starts from, so the
        engine's logprobs (a cached prefix's KV equals a recomputed one to rounding only) do not
        depend on where the run was resumed."""
        for engine in [self.engine, *(e for e, _ in self.whole)]:
            getattr(engine, "drop_prefix_cache", lambda: None)()

    def attach_whole(self, engine: Any, slot: EngineSlot) -> None:
        """A whole-model policy's local engine (on its model itself), and its gateway slot."""
        self.whole.append((engine, slot))

    def engine_weights(self, version: int) -> tuple[torch.nn.Module, int]:
        """(module, version) the engine starts on: the policy's, or its own copy (made now from
        the policy unless a checkpoint restored one)."""
        if not self.own_copy:
            self.engine_model = None  # (a checkpoint of an overlapping run may hold engine weights)
            return self.model, version
        if self.engine_model is None:
            self.engine_model, self.engine_version = copy.deepcopy(self.model).eval(), version
        return self.engine_model, self.engine_version

    def attach(self, engine: Any, slot: EngineSlot | None) -> None:
        """The engine started on `engine_weights`, and its slot in the in-process gateway."""
        self.engine, self.slot = engine, slot
        # a server holds its weights elsewhere: engine_model mirrors them for the checkpoint
        self.mirror = (self.engine_model is not None
                       and getattr(engine, "model", None) is not self.engine_model)

    @property
    def shared(self) -> bool:
        """The engine decodes with the policy module itself."""
        return getattr(self.engine, "model", None) is self.model

    def check_engine(self) -> None:
        """A vLLM server that died stops the run here (its rollouts failed with its error)."""
        server = getattr(self.engine, "server", None)
        if server is not None:
            server.check_alive()

    async def run_update(self, gateway: GatewayClient, run_update: Callable[[], Awaitable[Any]],
                         version: int) -> tuple[Any, dict[str, float]]:
        """Run the optimizer update (`run_update()`), which makes the policy `version`; -> (its
        result, {"time/update_s", "time/sync_s"}). Shared weights change inside a held window and
        the engine's version moves with them (time/sync_s: its update_weights, a bf16 engine's
        copy refreshed); a sleeping server sleeps through it; an own copy is left as it is (`send`
        or `catch_up` gives it the new weights, and times that)."""
        held = self.shared or self.sleep_level
        async with contextlib.AsyncExitStack() as windows:
            for slot in ([self.slot] if held else []) + [slot for _, slot in self.whole]:
                await windows.enter_async_context(held_engine(gateway, slot))
            if self.sleep_level:
                await self.engine.sleep(self.sleep_level)
            t = time.perf_counter()
            result = await run_update()
            t_sync = time.perf_counter()
            if self.shared:
                self.engine.update_weights(None, version)
            for engine, _ in self.whole:
                engine.update_weights(None, version)
            times = {"time/update_s": t_sync - t, "time/sync_s": time.perf_counter() - t_sync}
        return result, times

    async def send(self, gateway: GatewayClient, version: int) -> dict[str, float]:
        """An engine with its own copy takes the policy's weights (`version`) now, in a held
        window; -> {"time/sync_s"} (nothing for shared weights)."""
        if self.shared:
            return {}
        t = time.perf_counter()
        async with held_engine(gateway, self.slot):
            await self.push(version)
        return {"time/sync_s": time.perf_counter() - t}

    async def catch_up(self, gateway: GatewayClient, version: int) -> float:
        """An engine with its own copy takes the policy's weights (`version`), in a held window;
        nothing when it holds them already. -> its seconds (0.0: nothing to do)."""
        if self.shared or self.engine.model_version == version:
            return 0.0
        t = time.perf_counter()
        async with held_engine(gateway, self.slot):
            await self.push(version)
        return time.perf_counter() - t

    async def push(self, version: int) -> None:
        """The policy's weights into the engine's own copy; call it in a held window."""
        await self.engine.load_weights(self.model, version)
        if self.mirror:
            lora.load_weights(self.engine_model, lora.weights(self.model))
        self.engine_version = version

    def keep_for_resume(self) -> None:
        """The last step's eval is about to give the engine newer weights: the checkpoint keeps
        the ones the next step's rollouts come from."""
        self.next_weights = {"version": self.engine_version, "model": {
            k: v.clone() for k, v in lora.weights(self.engine_model).items()}}

    def checkpoint(self) -> dict | None:
        """What a checkpoint keeps of the engine (own copy only): the weights the next step's
        rollouts come from and their version."""
        if self.engine_model is None:
            return None
        return self.next_weights or {"model": lora.weights(self.engine_model),
                                     "version": self.engine_version}

    def restore(self, saved: dict | None) -> None:
        """The engine's copy of a checkpoint (`checkpoint`'s), on a copy of the policy."""
        if saved is not None:
            self.engine_model = copy.deepcopy(self.model)
            lora.load_weights(self.engine_model, saved["model"])
            self.engine_version = saved["version"]
