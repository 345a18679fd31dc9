"""The engine a run's config names (`engine.kind`), started on the weights the next collect uses.

    ENGINE_KINDS[kind](cfg, weights, tokenizer, version=..., run_dir=..., threads=..., log=...,
                       lockstep=...) -> an engine (engines/base.py's contract)

A new kind is one function registered with `@register_engine("kind")` (registry.ENGINE_KINDS:
the names `engine.kind` accepts; a user's module registers one through the config's `plugins`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from tracetrain import registry
from tracetrain.config import ConfigError, TrainConfig
from tracetrain.models import lora

StartEngine = Callable[..., Awaitable[Any]]
ENGINE_KINDS = registry.ENGINE_KINDS
register_engine = ENGINE_KINDS.register


def preflight(cfg: TrainConfig) -> None:
    """What the configured engine cannot do here, refused before any work (a ConfigError naming
    the key): an engine.python that does not run vLLM; sync nccl and sleep_level on a machine
    without CUDA GPUs."""

    ec = cfg.engine
    if getattr(ec, "python", None) is not None:  # (a key of kind vllm and a plugin's)
        from tracetrain.engines.vllm_server import check_interpreter

        check_interpreter(ec.python)
    if ec.kind == "vllm" and not torch.cuda.is_available():
        for key, on in (("sync", ec.sync == "nccl"), ("sleep_level", ec.sleep_level)):
            if on:
                raise ConfigError(f"config key 'engine.{key}': {getattr(ec, key)!r} is for CUDA "
                                  "GPUs and this machine has none")


async def start_engine(cfg: TrainConfig, weights: torch.nn.Module, tokenizer, *, version: int,
                       run_dir: Path, threads: int, log=print, lockstep=None):
    """The engine of kind cfg.engine.kind, serving `weights` as model version `version`;
    `lockstep` (agents/lockstep.py, when cfg.reproducible): the engine closes its batches by it."""
    return await ENGINE_KINDS[cfg.engine.kind](cfg, weights, tokenizer, version=version,
                                               run_dir=run_dir, threads=threads, log=log,
                                               lockstep=lockstep)


@register_engine("local")
async def start_local(cfg: TrainConfig, weights, tokenizer, *, version, run_dir, threads, log,
                      lockstep=None):
    """In this process, decoding with the module itself (shared with the optimizer unless the
    trainer gives it a copy)."""
    from tracetrain.engines.layers import Unservable
    from tracetrain.engines.local import LocalEngine
    from tracetrain.engines.local_options import LocalOptions

    ec = cfg.engine
    try:
        engine = LocalEngine(weights, tokenizer, LocalOptions(
            max_batch_size=4096, model_version=version, seed=cfg.trainer.seed, threads=threads,
            batch_window_ms=ec.batch_window_ms, lockstep=lockstep,
            prefix_cache_bytes=ec.prefix_cache_mb << 20, prefix_cache=ec.prefix_cache_mb > 0,
            precision=ec.precision, compile=ec.compile))
    except Unservable as e:  # before any rollout: the run cannot work
        raise ConfigError(f"config key 'model': {e} (engine.kind 'vllm' may serve it)") from None
    log(f"engine decode step: {engine.graph_note}")
    if engine.precision_s is not None:
        log(f"engine.precision auto: {engine.precision} (a decode step, best of 3: " + ", ".join(
            f"{p} {s * 1e3:.1f} ms" for p, s in engine.precision_s.items()) + ")")
    return engine


@register_engine("vllm")
async def start_vllm(cfg: TrainConfig, weights, tokenizer, *, version, run_dir, threads, log,
                     lockstep=None):
    """A vLLM server launched on the weights (engine.python), or a running one (engine.base_url)
    they are pushed to; under LoRA the server holds the base and takes the adapter
    (engines/vllm.py)."""
    from tracetrain.engines.vllm import LoraTransport, NcclTransport, VLLMEngine
    from tracetrain.engines.vllm_server import VLLMServer
    from tracetrain.models.save import write_hf_dir

    ec, ac = cfg.engine, cfg.aggregate
    transport = NcclTransport() if ec.sync == "nccl" else None
    if cfg.model.lora is not None:  # the server holds the base, each sync brings the adapter
        transport = LoraTransport(run_dir / "engine-adapter", cfg.model.lora.r)
    if cfg.policies is not None:  # several policies: each its adapter, served by its name
        transport = LoraTransport(run_dir / "engine-adapter",
                                  max(lc.r for lc in cfg.adapter_policies.values()),
                                  list(cfg.adapter_policies))
    max_len = ec.max_model_len or ac.max_prompt_length + ac.max_response_length
    weights_dir = run_dir / "engine-weights"
    await asyncio.to_thread(lambda: write_hf_dir(lora.base(weights), tokenizer, weights_dir))
    if ec.python is not None:
        log(f"starting vLLM ({ec.python}), log in {run_dir / 'vllm.log'}")
        server = await asyncio.to_thread(
            VLLMServer.launch, ec.python, weights_dir, run_dir / "vllm.log",
            args=(transport.server_args if transport else [])
            + (["--enable-sleep-mode"] if ec.sleep_level else []) + ec.args,
            max_model_len=max_len, dtype=str(next(weights.parameters()).dtype).removeprefix("torch."),
            env={**getattr(transport, "env", {}), **ec.env}, start_timeout_s=ec.start_timeout_s)
    else:
        server = await asyncio.to_thread(VLLMServer.running, ec.base_url, ec.start_timeout_s)
    engine = VLLMEngine(server, tokenizer, weights_dir, max_context=max_len,
                        timeout=ec.request_timeout_s, model_version=version, transport=transport)
    try:
        # a server started by someone else: make it serve our weights; LoRA: load the adapter
        if ec.python is None or cfg.model.lora is not None or cfg.policies is not None:
            await engine.load_weights(weights, version)
    except BaseException:
        await engine.aclose()
        raise
    return engine
