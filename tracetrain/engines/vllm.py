"""`vllm` engine: a vLLM server that generates the rollouts and takes the trainer's weights after
every update. Requests go through `UpstreamEngine` (exact prompt ids in, token ids and logprobs
out); the weights go by disk:

    write_hf_dir(model, tokenizer, DIR)           # the policy as a Hugging Face directory
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /reset_prefix_cache                      # no KV cache of the old weights answers again

`load_weights` is called while the gateway holds new requests and none is in flight (the
trainer's held_engine), so no request sees half of an update; the turns that follow carry the new
`model_version`.

engine.sync nccl (GPUs): the weights go over NCCL by vLLM's weight-transfer engine instead of the
disk (the server runs with `--weight-transfer-config {"backend": "nccl"}`). The trainer joins as
rank 0 by a unique id it mints itself (torch.cuda.nccl), so it needs no vLLM of its own:

    POST /init_weight_transfer_engine {"init_info": {"nccl_unique_id_b64": B64, "rank_offset": 1,
        "world_size": 1 + W, "packed": false}}   while rank 0 joins and does the one-element
                                                 all_reduce every vLLM communicator starts with
    per update:  POST /start_weight_update
                 POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}  while
                     rank 0 broadcasts each tensor, in that order
                 POST /finish_weight_update {"weight_version": "V"}
                 POST /reset_prefix_cache

model.lora: the server is launched on the base weights (lora.base, written once) with LoRA
enabled, and each sync writes and loads only the adapter (LoraTransport); requests then name the
adapter as their model.

The policy is written by models/save.py (write_hf_dir, write_weights), untied: see there why.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import torch

from tracetrain.config import ConfigError
from tracetrain.engines.base import EngineError, Generation, OnTokens, SamplingParams
from tracetrain.engines.upstream import UpstreamEngine
from tracetrain.engines.vllm_server import SERVED_NAME, VLLMServer
from tracetrain.models.lora import BASE
from tracetrain.models.save import untied_state_dict, write_weights


class TorchNccl:
    """The NCCL calls of the nccl transport, by torch.cuda.nccl (tests give a recording stand-in)."""

    def unique_id(self) -> bytes:
        return torch.cuda.nccl.unique_id()

    def join(self, world_size: int, uid: bytes, rank: int):
        comm = torch.cuda.nccl.init_rank(world_size, uid, rank)
        handshake = torch.zeros(1, device="cuda")
        torch.cuda.nccl.all_reduce([handshake], comms=[comm])
        return comm

    def broadcast(self, comm, tensor: torch.Tensor) -> None:
        torch.cuda.nccl.broadcast([tensor.to("cuda").contiguous()], root=0, comms=[comm])
        torch.cuda.synchronize()


def update_info(weights: dict[str, torch.Tensor]) -> dict:
    """What vLLM's nccl engine is told to receive, in the order it is broadcast."""
    return {"names": list(weights),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()]}


class NcclTransport:
    """engine.sync nccl: see the module docstring."""

    server_args = ["--weight-transfer-config", '{"backend": "nccl"}']

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else TorchNccl()
        self.comm = None

    async def connect(self, engine: VLLMEngine) -> None:
        answer = await engine._call("GET", "/get_world_size", params={"include_dp": "true"})
        world = 1 + int(answer["world_size"])
        uid = self.ops.unique_id()
        init = {"nccl_unique_id_b64": base64.b64encode(uid).decode(), "rank_offset": 1,
                "world_size": world, "packed": False}
        both = asyncio.gather(engine._post("/init_weight_transfer_engine", {"init_info": init}),
                              asyncio.to_thread(self.ops.join, world, uid, 0))
        self.comm = (await both)[1]  # every rank enters the rendezvous at once

    async def push(self, engine: VLLMEngine, model: torch.nn.Module, version: int) -> None:
        if self.comm is None:
            await self.connect(engine)
        weights = untied_state_dict(model)
        await engine._post("/start_weight_update")
        receive = asyncio.ensure_future(
            engine._post("/update_weights", {"update_info": update_info(weights)}))
        try:
            for tensor in weights.values():  # the workers receive inside /update_weights
                await asyncio.to_thread(self.ops.broadcast, self.comm, tensor)
        finally:
            await receive
        await engine._post("/finish_weight_update", {"weight_version": str(version)})


class DiskTransport:
    """engine.sync disk: see the module docstring."""

    server_args: list[str] = []

    def __init__(self, weights_dir: str | Path):
        self.weights_dir = Path(weights_dir)

    async def push(self, engine: VLLMEngine, model: torch.nn.Module, version: int) -> None:
        await asyncio.to_thread(write_weights, model, self.weights_dir)
        await engine._post("/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": str(self.weights_dir.resolve())}})


ADAPTER_NAME = "policy-adapter"  # the model name of requests once an adapter is loaded
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's choices of --max-lora-rank


def write_adapter(model: torch.nn.Module, directory: str | Path, adapter: str | None = None) -> Path:
    """The peft model's adapter alone (several policies: adapter `adapter`) as a PEFT directory
    (adapter_config.json, adapter_model.safetensors), written beside and renamed: a reader never
    sees half of it."""
    import shutil

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **({} if adapter is None else {"selected_adapters": [adapter]}))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp if adapter is None else tmp / adapter, directory)  # (peft: a named one in a folder)
    shutil.rmtree(tmp, ignore_errors=True)
    return directory


class LoraTransport:
    """model.lora, or several policies (`names`: an adapter each, served under its policy's name,
    the base under its own; requests name theirs, SamplingParams.adapter): the server holds the base
    weights from its launch and applies the adapter itself (--enable-lora, runtime loading allowed
    by VLLM_ALLOW_RUNTIME_LORA_UPDATING); each push writes only the adapter, as ROOT/vVERSION, and
    replaces the served one:

        POST /v1/unload_lora_adapter {"lora_name": "policy-adapter"}   (when the server has it)
        POST /v1/load_lora_adapter {"lora_name": "policy-adapter", "lora_path": ROOT/vVERSION}

    From then on the engine's requests name the adapter as their model, so vLLM generates with
    base + adapter. The window between the two calls has no adapter; the push runs drained, so no
    request falls in it. Not `load_inplace`: vLLM 0.32 keeps that flag on the adapter's request
    and reloads the adapter from disk at every scheduler step that uses it. The previous version's
    directory is removed once the new one is loaded."""

    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def __init__(self, adapter_root: str | Path, rank: int, names: list[str] | None = None):
        if rank > LORA_RANKS[-1]:
            key = "model.lora.r" if names is None else "policies.*.lora.r"
            raise ConfigError(f"config key '{key}': {rank} is more than vLLM's largest "
                              f"LoRA rank {LORA_RANKS[-1]}")
        self.root, self.names = Path(adapter_root), names
        self.server_args = ["--enable-lora", "--max-loras", str(len(names or [None])),
                            "--max-lora-rank", str(min(r for r in LORA_RANKS if r >= rank))]
        self.loaded: dict[str, Path] = {}  # lora name -> the adapter directory the server serves

    async def push(self, engine: VLLMEngine, model: torch.nn.Module, version: int) -> None:
        import shutil

        served = await engine._call("GET", "/v1/models")
        ids = {m.get("id") for m in served.get("data", [])}
        adapters = [(ADAPTER_NAME, None)] if self.names is None else [(n, n) for n in self.names]
        for lora_name, adapter in adapters:
            path = (self.root / (lora_name if adapter else "") / f"v{version}").resolve()
            await asyncio.to_thread(write_adapter, model, path, adapter)
            if lora_name in ids:
                await engine._post("/v1/unload_lora_adapter", {"lora_name": lora_name})
            await engine._post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(path)})
            old = self.loaded.get(lora_name)
            if old is not None and old != path:
                await asyncio.to_thread(shutil.rmtree, old, True)
            self.loaded[lora_name] = path
        if self.names is None:
            engine.served_model = ADAPTER_NAME
        else:  # the base as served at launch; each policy's adapter by its name
            engine.adapter_models = {**{n: n for n in self.names}, BASE: engine.served_model}


class VLLMEngine(UpstreamEngine):
    """UpstreamEngine over a vLLM server (launched or running) that takes new weights by
    `transport` (DiskTransport on weights_dir when none is given)."""

    def __init__(self, server: VLLMServer, tokenizer, weights_dir: str | Path, *, max_context: int,
                 timeout: float = 300.0, model_version: int = 0, transport=None):
        super().__init__(server.base_url, SERVED_NAME, tokenizer, name="vllm", max_context=max_context,
                         timeout=timeout, model_version=model_version)
        self.server = server
        self.transport = transport if transport is not None else DiskTransport(weights_dir)
        self.stats["weight_syncs"] = 0
        self.sleeping = 0  # the level of the server's sleep, 0: awake

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: OnTokens | None = None
    ) -> Generation:
        self.server.check_alive()  # a dead server: its exit code and log now, not after retries
        try:
            return await super().generate(prompt_ids, params, on_tokens)
        except EngineError:
            self.server.check_alive()
            raise

    async def _call(self, method: str, route: str, body: dict | None = None, params=None) -> Any:
        """One call to the server's admin routes on the engine's pooled session; its JSON answer
        (a plain-text answer as text)."""
        try:
            async with self._http().request(method, self.base_url + route, json=body,
                                            params=params) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.server.check_alive()
            raise EngineError(f"vllm {route}: {type(e).__name__}: {e}", 503) from None
        if status != 200:
            raise EngineError(f"vllm {route} answered HTTP {status}: "
                              f"{raw[:500].decode(errors='replace')}", 502)
        try:
            return json.loads(raw) if raw else None
        except ValueError:  # e.g. /v1/load_lora_adapter's "Success: ..."
            return raw.decode(errors="replace")

    async def _post(self, route: str, body: dict | None = None, params=None) -> Any:
        return await self._call("POST", route, body, params)

    async def sleep(self, level: int) -> None:
        """Free the server's GPU memory for the update (engine.sleep_level; vLLM started with
        --enable-sleep-mode): level 1 offloads the weights to CPU memory and drops the KV cache,
        level 2 drops both (the next load_weights brings new ones). Call it drained."""
        await self._post("/sleep", params={"level": level})
        self.sleeping = level

    async def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Push the weights by the transport (under LoRA: the adapter alone), drop the server's
        prefix cache, take `version`.
        Call it with no request in flight (the gateway's drain). A sleeping server is woken:
        level 2 gets its weights' memory first, the KV cache after the push."""
        self.server.check_alive()
        if self.sleeping:
            await self._post("/wake_up", params={"tags": "weights"} if self.sleeping == 2 else None)
        await self.transport.push(self, model, version)
        if self.sleeping == 2:
            await self._post("/wake_up", params={"tags": "kv_cache"})
        self.sleeping = 0
        await self._post("/reset_prefix_cache")
        self.model_version = version
        self.stats["weight_syncs"] += 1

    async def aclose(self) -> None:
        await super().aclose()
        self.server.stop()
