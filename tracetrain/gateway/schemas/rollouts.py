"""The rollout API's bodies (rollout_routes.py): strict, every field checked."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, JsonValue

from tracetrain.gateway.schemas.base import Id, State, Strict
from tracetrain.types import ROLE_PATTERN


class NewRolloutIn(Strict):
    rollout_id: Id | None = Field(None, description="default: a new random id")
    group_id: Id | None = Field(None, description="default: the rollout id (a group of one)")
    task: JsonValue = Field(None, description="the task input, any JSON")
    engine: Id | None = Field(None, description="engine name; default: the gateway's default")


class CreateRolloutsIn(Strict):
    rollouts: list[NewRolloutIn] = Field(min_length=1, max_length=10_000)


class RolloutOut(BaseModel):
    rollout_id: str
    group_id: str
    task: JsonValue
    engine: str | None
    state: State
    error: str | None
    reward: float | None
    n_turns: int
    created_at: float
    updated_at: float


class CreatedRolloutOut(RolloutOut):
    created: bool = Field(description="false when the id existed (idempotent create)")
    base_url: str = Field(description="OpenAI base URL for this rollout's agent")
    api_key: str = Field(description="this rollout's key; shown here only")


class CreateRolloutsOut(BaseModel):
    rollouts: list[CreatedRolloutOut]


# A turn reward's name: what it is for ("tests_passed", "tool_error"); a role name's characters.
RewardName = Annotated[str, Field(pattern=f"^{ROLE_PATTERN.pattern}$", max_length=100)]


class TurnRewardIn(Strict):
    reward: float = Field(description="finite")
    turn: int | None = Field(None, ge=0, description="the turn's index; null: the latest turn")
    name: RewardName | None = Field(None, description="what it is for, e.g. tests_passed")


class TurnRewardOut(BaseModel):
    reward_id: int
    rollout_id: str
    turn: int
    reward: float
    name: str | None
    created_at: float


class TurnOut(BaseModel):
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None
    model_version: int | None
    finish_reason: str | None
    created_at: float
    context: Literal["exact", "rendered"] | None = Field(
        description="how the prompt was built: the earlier turn's ids plus the new messages "
        "(exact), or the chat template's full render (rendered); null for /v1/completions"
    )
    context_reason: str | None = Field(
        description="why a chat prompt was rendered in full: policy, first_turn, forgotten, "
        "no_match, template_prefix"
    )
    reused_tokens: int = Field(description="prompt ids taken as they were from the earlier turn")
    role: str = Field(description="the agent that made the call: the role's base URL, else the "
                      "request's `model`, else 'policy'")
    rewards: list[TurnRewardOut] = Field(description="rewards given to this turn, in order")


class RolloutDetailOut(RolloutOut):
    turns: list[TurnOut] | None


class RolloutPageOut(BaseModel):
    rollouts: list[RolloutOut]
    next_cursor: int | None = Field(
        description="pass as `cursor` for the next page; null at the end"
    )


class PatchRolloutIn(Strict):
    state: State | None = None
    error: str | None = Field(None, max_length=100_000)
    reward: float | None = Field(
        None, description="override the reward (null clears the override); absent: unchanged"
    )


class PatchRolloutItemIn(PatchRolloutIn):
    rollout_id: Id


class PatchRolloutsIn(Strict):
    rollouts: list[PatchRolloutItemIn] = Field(min_length=1, max_length=10_000)


class PatchResultOut(BaseModel):
    """One item of a bulk patch: the rollout after it (status 200), or why it was not changed
    (404: no such rollout, 409: an illegal state change); the other items still apply."""

    status: int
    rollout: RolloutOut | None
    error: str | None


class PatchRolloutsOut(BaseModel):
    rollouts: list[PatchResultOut]


class RewardIn(Strict):
    reward: float
    info: JsonValue = None


class EventIn(Strict):
    kind: Annotated[str, Field(min_length=1, max_length=100)]
    payload: JsonValue = None


class EventOut(BaseModel):
    event_id: int
    kind: str
    payload: JsonValue
    reward: float | None
    created_at: float


class EventsOut(BaseModel):
    events: list[EventOut]
