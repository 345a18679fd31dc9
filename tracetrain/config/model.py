"""The policy's sections: the model it starts from, its LoRA adapter, and the several policies
of a run (`policies`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tracetrain.config.base import _Section, named_once
from tracetrain.types import check_role


class RemoteModelConfig(_Section):
    """A model behind an OpenAI-compatible chat completions endpoint (vLLM, SGLang, a hosted API):
    how an expert (warm_start.expert) is named."""

    url: str = Field(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    """The endpoint's base URL, e.g. `http://127.0.0.1:8000/v1` (requests go to its
    /chat/completions)."""
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


# peft names the rows of a batch without an adapter "__base__"; an adapter's name must not be
# part of its layers' prefix "lora_" (peft would take its weights for a layer's on loading).
RESERVED_POLICY_NAMES = ("__base__",)
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # (an adapter's name is a module key)


class PolicyConfig(_Section):
    """One of several policies of a run (`policies`): a LoRA adapter on the run's base model
    (`model`), or a whole model of its own, making its roles' calls and learning from their
    trained tokens only, with its own optimizer and learning-rate schedule (docs/policies.md)."""

    roles: list[str] = Field(min_length=1)
    """The roles whose calls this policy makes and learns from; a role belongs to one policy at
    most (a role of none is served by the base model, without an adapter, and does not train)."""
    lora: LoraConfig | None = Field(default_factory=LoraConfig)
    """Its adapter on the run's base model (rank, alpha, target layers); null: a whole model of
    its own, every weight trained: `model`, or without it a copy of the run's model as RL starts
    (after the warm start, which trains the model every policy starts from)."""
    model: ModelConfig | None = None
    """Its own model (a whole model, every weight trained; `lora` is then null unless given);
    the tokenizer must be the run's model's. null: `lora` on the run's model, or its copy."""
    lr: float | None = Field(None, gt=0)
    """Its AdamW learning rate; null: `optim.lr`."""
    warmup_steps: int | None = Field(None, ge=0)
    """Its learning-rate warm-up; null: `optim.warmup_steps`."""
    decay: Literal["constant", "cosine", "linear"] | None = None
    """Its learning-rate decay; null: `optim.decay`."""
    weight_decay: float | None = Field(None, ge=0)
    """Its weight decay; null: `optim.weight_decay`."""
    grad_clip: float | None = Field(None, gt=0)
    """Its gradient norm clip; null: `optim.grad_clip`."""
    kl_coef: float | None = Field(None, ge=0)
    """Its KL penalty against the base model; null: `loss.kl_coef`."""

    @field_validator("roles")
    @classmethod
    def _role_names(cls, v: list[str]) -> list[str]:
        for role in v:
            check_role(role)
        return named_once(v, "a role")

    @model_validator(mode="before")
    @classmethod
    def _own_model_is_whole(cls, data: Any) -> Any:
        """`model` without `lora`: the model whole (the adapter's default is not meant)."""
        if isinstance(data, dict) and data.get("model") is not None and "lora" not in data:
            return {**data, "lora": None}
        return data

    @property
    def whole(self) -> bool:
        """A whole model of its own (`model`, or a copy of the run's), not an adapter."""
        return self.lora is None
