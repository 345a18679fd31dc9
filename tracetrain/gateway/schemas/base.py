"""What every body of the gateway shares: strict and loose models, ids, rollout states.

Rollout API bodies are strict: wrong types are errors (422, naming the field), unknown fields are
errors, non-finite numbers are errors. OpenAI bodies accept unknown fields (agent harnesses send
many) but type-check the ones the gateway uses.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

State = Literal["queued", "running", "succeeded", "failed", "timed_out"]
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
Id = Annotated[str, Field(min_length=1, max_length=200, pattern=ID_PATTERN)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Loose(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
