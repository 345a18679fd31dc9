"""The several policies of a run (`policies`): each one's roles, adapter or model, optimizer
settings and teacher."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tracetrain.config.base import _Section, named_once
from tracetrain.config.distill import DistillConfig
from tracetrain.config.model import LoraConfig, ModelConfig
from tracetrain.types import check_role

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
    distill: DistillConfig | None = None
    """Its teacher (on-policy distillation of its roles' tokens; `distill.roles`: a part of
    them); null: none. Several policies name their teachers here, not in the run's `distill`."""

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
