"""OpenAI Responses API bodies (responses_routes.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from tracetrain.gateway.schemas.base import Loose, Strict


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
