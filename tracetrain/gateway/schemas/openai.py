"""OpenAI Chat Completions and Completions bodies (openai_routes.py): unknown fields accepted
(agent harnesses send many), the fields the gateway uses type-checked."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field
from typing_extensions import TypedDict

from tracetrain.gateway.schemas.base import Loose, Strict


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
