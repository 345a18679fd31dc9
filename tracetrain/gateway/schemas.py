"""Request and response bodies (pydantic). They are the OpenAPI schema of the gateway.

Rollout API bodies are strict: wrong types are errors (422, naming the field), unknown fields are
errors, non-finite numbers are errors. OpenAI bodies accept unknown fields (agent harnesses send
many) but type-check the ones the gateway uses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Discriminator, Field, JsonValue, Tag
from typing_extensions import TypedDict

from tracetrain.types import ROLE_PATTERN

State = Literal["queued", "running", "succeeded", "failed", "timed_out"]
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
Id = Annotated[str, Field(min_length=1, max_length=200, pattern=ID_PATTERN)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Loose(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# ------------------------------------------------------------------------------- rollouts


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


# -------------------------------------------------------------------------------- engines


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


# --------------------------------------------------------------------------------- OpenAI


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(TypedDict):
    """Role and content are checked; every other field (tool_calls, tool_call_id, name, ...)
    reaches the chat template as sent (the gateway reads the messages from the request's JSON)
    and is not copied here. A TypedDict, not a model: checking a long history is then a third of
    the cost (no object per message)."""

    __pydantic_config__ = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # type: ignore[misc]
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: NotRequired[str | list[TextPart] | None]


class StreamOptions(Loose):
    include_usage: bool = False


class _Sampling(Loose):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_token_ids: bool | None = Field(
        False, description="add prompt_token_ids and choices[].token_ids to the answer"
    )


class ChatCompletionIn(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionIn(_Sampling):
    prompt: (
        str
        | list[Annotated[int, Field(ge=0)]]
        | list[str]
        | list[list[Annotated[int, Field(ge=0)]]]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


# ------------------------------------------------------------------------- OpenAI Responses


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # output_text carries them back; not used
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    """A message in `input`: `type` may be left out."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(BaseModel):
    """A call the model made (sent back from an earlier response's `output`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]


class ReasoningItem(BaseModel):
    """Reasoning from an earlier response, sent back: accepted and not rendered (the gateway
    never produces these items; with `context: exact` the model's own tokens are kept anyway)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["reasoning"]


def _item_type(v: Any) -> str:
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesIn(Loose):
    """OpenAI Responses API request (POST /v1/responses). Unknown fields are accepted and
    ignored (`store`, `metadata`, `user`, `parallel_tool_calls`, `include`, ...)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    seed: int | None = None  # not in OpenAI's API; honoured when sent
    return_token_ids: bool | None = Field(
        False, description="add prompt_token_ids and token_ids to the response"
    )


# ------------------------------------------------------------------------ Anthropic Messages


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """Reasoning sent back (thinking / redacted_thinking): accepted, not rendered."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["thinking", "redacted_thinking"]


def _block_type(v: Any) -> str:
    return v.get("type", "") if isinstance(v, dict) else getattr(v, "type", "")


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class AnthropicMessage(_Block):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Block):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesIn(Loose):
    """Anthropic Messages API request (POST /v1/messages). Unknown fields are accepted and
    ignored (`metadata`, `service_tier`, ...)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = False
    return_token_ids: bool | None = Field(
        False, description="add prompt_token_ids and token_ids to the message"
    )
