"""Anthropic Messages bodies (anthropic_routes.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from tracetrain.gateway.schemas.base import Loose


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
