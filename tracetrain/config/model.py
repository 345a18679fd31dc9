"""The policy's sections: the model it starts from and its LoRA adapter; how a model behind a URL
is named."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tracetrain.config.base import _Section


class RemoteModelConfig(_Section):
    """A model behind an OpenAI-compatible endpoint (vLLM, SGLang, a hosted API): how an expert
    (warm_start.expert) or a teacher (distill.teacher) is named."""

    url: str = Field(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    """The endpoint's base URL, e.g. `http://127.0.0.1:8000/v1` (an expert's requests go to its
    /chat/completions, a teacher's to its /completions, and to the server's /tokenize)."""
    name: str = Field(min_length=1)
    """The model name the endpoint serves (the request's `model`)."""
    api_key_env: str | None = None
    """The environment variable holding its API key (null: no key is sent)."""


class LoraConfig(_Section):
    """LoRA (peft): train a low-rank adapter on the named linear layers, the base frozen."""

    r: int = Field(16, gt=0)
    """The adapter's rank."""
    alpha: float = Field(32.0, gt=0)
    """Scale: the adapter adds (alpha / r) · B A to each target weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (0: the update's forward pass equals the
    engine's)."""
    target_modules: list[str] | None = Field(None, min_length=1)
    """Names of the layers that get an adapter, as peft matches them (a module whose name is one,
    or ends in "." + one); each must match a module of the model. null: every linear projection
    of the model's decoder blocks, as its architecture names them (tracetrain/models/lora.py:
    q/k/v/o_proj and gate/up/down_proj of Llama-family models, phi3's fused qkv_proj and
    gate_up_proj, ...); MoE experts and routers are left alone unless named."""


class ModelConfig(_Section):
    """Where the policy comes from: a tiny model built from a config, a transformers model (a local
    directory or a Hugging Face id), or a GGUF file."""

    kind: Literal["tiny", "pretrained", "gguf"] = "tiny"
    """`tiny`: a small Llama built offline from the sizes below, with tracetrain's byte-level
    tokenizer; `pretrained`: the transformers model at `path`; `gguf`: `gguf_file` in `path`,
    loaded dequantized as a plain trainable transformers model. Backend `verl` needs
    `pretrained`."""
    path: str | None = None
    """The pretrained model's directory, or the directory holding the GGUF file (kind `gguf`: also
    an installed package that ships it); or a Hugging Face model id ("org/name"), its snapshot
    downloaded to the Hugging Face cache, or read from it when HF_HUB_OFFLINE=1 (a directory of
    that name comes first). Required for kinds `pretrained` and `gguf`."""
    revision: str | None = None
    """The Hub revision (a branch, tag or commit hash) when `path` is a Hugging Face model id;
    null: main."""
    gguf_file: str | None = None
    """The GGUF file's name in `path`; required for kind `gguf`."""
    hidden_size: int = Field(128, gt=0)
    """Hidden size of the tiny model (kind `tiny` only)."""
    num_layers: int = Field(4, gt=0)
    """Transformer layers of the tiny model (kind `tiny` only)."""
    num_heads: int = Field(4, gt=0)
    """Attention heads of the tiny model (kind `tiny` only)."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads of the tiny model (grouped-query attention; kind `tiny` only)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The policy's weight dtype: the loaded model is cast to it (a launched vLLM server gets the
    same)."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """The attention kernel (transformers' name); null: transformers' default (sdpa). `eager` is
    the fast one for bf16-mixed training on CPU (sdpa's CPU backward in bf16 is several times
    slower)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (tracetrain/models/lora.py; needs `peft`, the `lora`
    extra): only the adapter is trained and checkpointed; `run_dir/policy` holds the merged model
    and the adapter (`policy/adapter`). Embedded backend. With engine.kind `vllm` the server is
    launched (`engine.python`) with LoRA enabled on the base weights and each sync loads only the
    adapter (engines/vllm.py); with the local engine, not with `trainer.collect: overlap`. null:
    full fine-tuning."""

    @model_validator(mode="after")
    def _needs_path(self) -> ModelConfig:
        if self.kind in ("pretrained", "gguf") and not self.path:
            raise ValueError(f"model.path is required when model.kind is {self.kind!r}")
        if self.kind == "gguf" and not self.gguf_file:
            raise ValueError("model.gguf_file is required when model.kind is 'gguf'")
        return self
