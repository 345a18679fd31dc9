"""The engine API's bodies (engine_routes.py): strict."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from tracetrain.gateway.schemas.base import Id, Strict


class RegisterEngineIn(Strict):
    name: Id
    base_url: Annotated[str, Field(min_length=1, max_length=2000, pattern=r"^https?://")]
    model: Annotated[str, Field(min_length=1, max_length=500)]
    tokenizer: str | None = Field(
        None, description="tokenizer path; default: the default engine's tokenizer"
    )
    max_context: Annotated[int, Field(ge=1)] | None = Field(
        None, description="prompt + max_tokens limit; default: the default engine's"
    )


class EngineOut(BaseModel):
    name: str
    kind: str
    model_version: int
    max_context: int
    paused: bool
    in_flight: int
    served: int
    spec: dict[str, Any] | None


class EnginesOut(BaseModel):
    engines: list[EngineOut]


class DrainOut(BaseModel):
    drained: bool
    in_flight: int
