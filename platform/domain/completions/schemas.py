"""The tenant-facing request shapes of /v1/chat/completions and /v1/completions: OpenAI's fields, strictly.

Unlike the engine server (lenient like vLLM), the hosted API refuses unknown fields as OpenAI does, and holds
every list and number to a bound so one request cannot ask for unbounded work.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from loraplex.engine.serve import ChatMessage as EngineChatMessage
from loraplex.engine.serve import completion_limit
from loraplex.platform.schemas import Name, RequestBody

MAX_STOP = 4
MAX_MESSAGES = 2048
MAX_TOKENS = 1_000_000

StopString = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
Identifier = Annotated[str, StringConstraints(max_length=256)]


class ChatMessage(EngineChatMessage):
    """The engine's message (a role and text content, as a string or `text` parts), held to OpenAI's fields and
    types: an unknown field or a non-string name is refused, not passed on."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Identifier | None = None


class StreamOptions(RequestBody):
    include_usage: bool = False


class ResponseFormat(RequestBody):
    type: Literal["text"]


class _Common(RequestBody):
    model: Name
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # more choices per request are not offered
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = None  # a routing hint inside the tenant, never across tenants
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    metadata: (
        Annotated[dict[Identifier, Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)] | None
    ) = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    # Accepted only absent: tool calling is not offered, and a chat template is the model's own.
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    chat_template: None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def limit(self) -> int | None:
        return completion_limit(self.max_completion_tokens, self.max_tokens)


class CompletionRequest(_Common):
    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    suffix: None = None

    @property
    def limit(self) -> int | None:
        return self.max_tokens
