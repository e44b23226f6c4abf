"""The request fields that ask for an output format: OpenAI's `response_format` and vLLM's `structured_outputs`
(the requests turn them into the engine's `StructuredOutputsParams`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: Annotated[Any, Field(alias="json")] = None  # a schema or its JSON text, checked by StructuredOutputsParams
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
