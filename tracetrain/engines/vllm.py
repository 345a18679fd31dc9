"""`vllm` engine: a vLLM server that generates the rollouts and takes the trainer's weights after
every update. Requests go through `UpstreamEngine` (exact prompt ids in, token ids and logprobs
out); the weights go by disk:

    write_hf_dir(model, tokenizer, DIR)           # the policy as a Hugging Face directory
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /reset_prefix_cache                      # no KV cache of the old weights answers again

`load_weights` is called while the gateway holds new requests and none is in flight (the
trainer's held_engine), so no request sees half of an update; the turns that follow carry the new
`model_version`.

Tied embeddings: a model whose output layer shares the input embedding is written untied
(lm_head.weight stored, tie_word_embeddings false). From a tied checkpoint as save_pretrained
writes it (no lm_head.weight), vLLM 0.32's in-place reload left the output layer on the old
weights (greedy output after a reload differed from transformers' on the new weights; the
regression test in tests/test_engine_vllm.py fails that way); with lm_head.weight stored the
reload reaches both. The logits are the same; the file holds the vocab x hidden matrix twice.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import httpx
import torch

from tracetrain.engines.base import EngineError, Generation, SamplingParams
from tracetrain.engines.upstream import UpstreamEngine
from tracetrain.engines.vllm_server import SERVED_NAME, VLLMServer

WEIGHTS_FILE = "model.safetensors"


def untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor its own (shared ones, e.g. tied embeddings,
    copied), contiguous and on the CPU: what safetensors stores."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        t = t.clone() if key in seen else t
        seen.add(key)
        out[name] = t.to("cpu").contiguous()
    return out


def untied_config(model: torch.nn.Module):
    config = copy.deepcopy(model.config)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    return config


def write_weights(model: torch.nn.Module, directory: str | Path) -> Path:
    """DIR/model.safetensors from the model (untied), written beside and renamed: a reader never
    sees half a file."""
    from safetensors.torch import save_file

    path = Path(directory) / WEIGHTS_FILE
    tmp = path.with_name(WEIGHTS_FILE + ".tmp")
    save_file(untied_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def write_hf_dir(model: torch.nn.Module, tokenizer, directory: str | Path) -> Path:
    """The policy as a Hugging Face directory (config, weights, tokenizer with its chat template,
    generation config): loadable by transformers and servable by vLLM as it is."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors*"):  # e.g. shards of an earlier save_pretrained
        stale.unlink()
    untied_config(model).save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_weights(model, directory)
    return directory


class VLLMEngine(UpstreamEngine):
    """UpstreamEngine over a vLLM server (launched or running) that takes new weights from disk."""

    def __init__(self, server: VLLMServer, tokenizer, weights_dir: str | Path, *, max_context: int,
                 timeout: float = 300.0, model_version: int = 0):
        super().__init__(server.base_url, SERVED_NAME, tokenizer, name="vllm", max_context=max_context,
                         timeout=timeout, model_version=model_version)
        self.server = server
        self.weights_dir = Path(weights_dir)
        self.stats["weight_syncs"] = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.server.check_alive()  # a dead server: its exit code and log now, not after retries
        try:
            return await super().generate(prompt_ids, params)
        except EngineError:
            self.server.check_alive()
            raise

    async def _post(self, route: str, body: dict | None = None) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            try:
                r = await http.post(self.base_url + route, json=body)
            except httpx.HTTPError as e:
                self.server.check_alive()
                raise EngineError(f"vllm {route}: {type(e).__name__}: {e}", 503) from None
        if r.status_code != 200:
            raise EngineError(f"vllm {route} answered HTTP {r.status_code}: {r.text[:500]}", 502)

    async def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Write the weights, reload them in the server, drop its prefix cache, take `version`.
        Call it with no request in flight (the gateway's drain)."""
        import asyncio

        self.server.check_alive()
        await asyncio.to_thread(write_weights, model, self.weights_dir)
        await self._post("/collective_rpc", {"method": "reload_weights",
                                             "kwargs": {"weights_path": str(self.weights_dir.resolve())}})
        await self._post("/reset_prefix_cache")
        self.model_version = version
        self.stats["weight_syncs"] += 1

    async def aclose(self) -> None:
        await super().aclose()
        self.server.stop()
