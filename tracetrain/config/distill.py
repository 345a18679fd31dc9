"""`distill`: a teacher that scores every token the policy samples (on-policy distillation;
objective/distill.py has the formula, run/teacher.py the scoring)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from tracetrain.config.base import _Section, named_once
from tracetrain.config.model import ModelConfig, RemoteModelConfig
from tracetrain.types import check_role


def _teacher_tag(data: Any) -> str:
    if isinstance(data, dict):
        return "remote" if "url" in data else "local"
    return "remote" if isinstance(data, RemoteModelConfig) else "local"


TeacherConfig = Annotated[
    Annotated[ModelConfig, Tag("local")] | Annotated[RemoteModelConfig, Tag("remote")],
    Discriminator(_teacher_tag),
]
"""`distill.teacher`: a model loaded here (the keys of `model`: a run's `policy/` folder or any
transformers directory or hub id with kind `pretrained`, a GGUF, a tiny model), or one a vLLM
server serves (`{url, name}`)."""


class DistillConfig(_Section):
    """On-policy distillation: a frozen teacher scores each token the policy sampled, and
    coef · (log π_teacher(y_t) − log π_sampled(y_t)) becomes token-level credit (docs/objective.md,
    "On-policy distillation")."""

    teacher: TeacherConfig
    """The teacher: `{kind: pretrained, path: runs/teacher/policy}` (a run's policy folder, a
    transformers directory or a hub id), `{kind: gguf, path, gguf_file}`, `{kind: tiny, ...}`,
    each loaded in this process and scored by a local engine (engines/score.py), or `{url, name,
    api_key_env}`: a vLLM server's model, asked for `prompt_logprobs`. Its tokenizer must be the
    policy's (the run is refused naming both otherwise). It never trains."""
    roles: list[str] | None = Field(None, min_length=1)
    """The trained roles it teaches; null: every role that trains (roles.train, or the policy's
    roles under `policies`)."""
    coef: float = Field(1.0, gt=0)
    """The weight of its term in the token's advantage."""
    with_reward: bool = False
    """false: a taught token's advantage is coef times the teacher's term alone (pure
    distillation; the environment's reward is still recorded and logged, not trained on); true:
    the reward-based advantage (advantage.estimator) plus it."""
    threads: int = Field(0, ge=0)
    """A local teacher's torch threads while it scores (0: the engine's, engine.threads)."""

    @field_validator("roles")
    @classmethod
    def _role_names(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for role in v:
            check_role(role)
        return named_once(v, "a role")

    @model_validator(mode="after")
    def _whole_teacher(self) -> DistillConfig:
        if isinstance(self.teacher, ModelConfig) and self.teacher.lora is not None:
            raise ValueError("distill.teacher.lora: the teacher does not train (give the model "
                             "with its adapter merged: a run's policy/ folder holds that)")
        return self
