"""A chat conversation's messages as OpenAI's SDK sends them: roles, text content (a string or `text` parts; images
and audio are refused by name, since these models read text only), tool calls and tool results, and how each
message is handed to a chat template."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, field_validator, model_validator

from loraplex.engine.serve.tool_calls import ToolCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


# Part types of OpenAI's chat API that carry something other than text: these models read text only.
NON_TEXT_PARTS = ("image_url", "input_audio", "file")


def check_content(value: Any) -> Any:
    """A message's `content` as OpenAI's SDK sends it: a string or a list of `{"type": "text", "text": ...}` parts.
    Raise ValueError naming what is wrong (an image or audio part by its type), for pydantic to report by field."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError('content must be a string or a list of {"type": "text", "text": ...} parts')
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if isinstance(kind, str) and kind in NON_TEXT_PARTS:
            raise ValueError(f"part {index} has type '{kind}': this model reads text only, send 'text' parts")
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"part {index} has type '{kind[:64]}', which is not supported: send 'text' parts")
        raise ValueError(f'part {index} must be {{"type": "text", "text": "..."}} with a string text')
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn that made tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None  # tool turns

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        return None if value is None else check_content(value)

    @model_validator(mode="after")
    def _fits_its_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        # Chat templates know system, user, assistant and tool; OpenAI's developer role is the system role renamed.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message
