"""The tenant-facing request shapes of /v1/chat/completions and /v1/completions: OpenAI's fields, strictly.

Unlike the engine server (lenient like vLLM), the hosted API refuses unknown fields as OpenAI does, and holds
every list and number to a bound so one request cannot ask for unbounded work.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

from loraplex.engine import MAX_THINKING_BUDGET
from loraplex.engine.serve import RESERVED_TEMPLATE_VARIABLES, NamedToolChoice, ToolDefinition, completion_limit
from loraplex.engine.serve import ChatMessage as EngineChatMessage
from loraplex.platform.schemas import Name, RequestBody

MAX_STOP = 4
MAX_MESSAGES = 2048
MAX_TOKENS = 1_000_000
MAX_LOGIT_BIAS = 300  # entries; OpenAI's bound on how many tokens one request may bias
MAX_CHOICES = 128  # for guided_choice
MAX_TOOLS = 128  # OpenAI's limit
MAX_N = 128  # OpenAI's limit on choices
MAX_TOP_K = 1_000_000
MAX_THINKING_TOKENS = MAX_THINKING_BUDGET  # the most a thinking_token_budget may be (the engine's bound on a tier's)
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_TEXT = 1000  # characters of a string value of chat_template_kwargs
# Variables the chat template gets from the request itself, or the tokenizer: a tenant may not set them through
# chat_template_kwargs (they would replace the conversation, the tools or the special tokens the template renders).
RESERVED_TEMPLATE_KWARGS: Final = RESERVED_TEMPLATE_VARIABLES
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

# OpenAI's reasoning_effort values (loraplex.engine's REASONING_EFFORTS, in that order).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]

StopString = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]  # logit_bias keys: JSON keys are strings
Bias = Annotated[float, Field(ge=-100, le=100)]
Choices = Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
Regex = Annotated[str, StringConstraints(min_length=1, max_length=10_000)]
Grammar = Annotated[str, StringConstraints(min_length=1, max_length=100_000)]
Identifier = Annotated[str, StringConstraints(max_length=256)]


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs (vLLM's): extra variables for the chat template, such as {"enable_thinking": false}. A
    few, named like identifiers, with JSON scalar values; never a variable the request or the tokenizer sets."""
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} variables")
    for name, item in value.items():
        if not _TEMPLATE_KWARG_NAME.fullmatch(name):
            raise ValueError(f"{name[:80]!r} is not a variable name (letters, digits and _, at most 64)")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{name} is set by the request or the tokenizer, not through chat_template_kwargs")
        if isinstance(item, str):
            if len(item) > MAX_TEMPLATE_TEXT:
                raise ValueError(f"{name}: a text value holds at most {MAX_TEMPLATE_TEXT} characters")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{name}: a number must be finite")
        elif isinstance(item, int) and not isinstance(item, bool):
            if abs(item) >= 2**63:
                raise ValueError(f"{name}: an integer must fit in 64 bits")
        elif item is not None and not isinstance(item, bool):
            raise ValueError(f"{name}: values are strings, numbers, booleans or null")
    return value


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]


class ChatMessage(EngineChatMessage):
    """The engine's message (a role and text content, as a string or `text` parts), held to OpenAI's fields and
    types: an unknown field or a non-string name is refused, not passed on."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Identifier | None = None


class StreamOptions(RequestBody):
    include_usage: bool = False


def _refuse(field_name: str, why: str, *, allow: tuple[Any, ...] = (None,)) -> Any:
    """A validator for a field accepted only at its default: anything else is refused saying why, and what is."""

    def check(value: Any) -> Any:
        if not any(value is default for default in allow):  # None and False are singletons
            defaults = " or ".join(json.dumps(a) for a in allow)
            raise ValueError(f"{why}: send {field_name} as {defaults} or leave it out")
        return value

    return check


class JsonSchemaFormat(RequestBody):
    """`response_format.json_schema`, as OpenAI defines it (the `openai` SDK's `parse` sends one)."""

    # The engine names the schema's field by its JSON key; `schema` itself would shadow a BaseModel attribute.
    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, StringConstraints(max_length=4096)] | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema: {name, schema, strict}")
        return self


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs`: exactly one of these (the engine says so if not)."""

    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)

    json_: Annotated[dict[str, Any] | None, Field(alias="json")] = None
    regex: Annotated[str, StringConstraints(min_length=1, max_length=10_000)] | None = None
    choice: (
        Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
        | None
    ) = None
    grammar: Annotated[str, StringConstraints(min_length=1, max_length=100_000)] | None = None
    json_object: bool | None = None


class _Common(RequestBody):
    model: Name
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # choices; the prompt is billed once (the engine prefills it once)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = None  # a routing hint inside the tenant, never across tenants
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's extras, as its users send them
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    top_k: Annotated[int, Field(ge=1, le=MAX_TOP_K)] | None = None  # also Anthropic's (the Messages API's)
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: Annotated[str, StringConstraints(min_length=1, max_length=10_000)] | None = None
    guided_choice: (
        Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
        | None
    ) = None
    guided_grammar: Annotated[str, StringConstraints(min_length=1, max_length=100_000)] | None = None
    structured_outputs: StructuredOutputs | None = None
    metadata: (
        Annotated[dict[Identifier, Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)] | None
    ) = None
    # OpenAI's tiers, without "scale" (and the SDK's newer names): "auto" or none is "default"; which of them a tenant
    # may use is its admin's call (service.resolve_service_tier).
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None

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
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template: Annotated[None, BeforeValidator(_refuse("chat_template", "the model's own template is used"))] = None
    # Reasoning models: the tier of thinking (its token budget is the base model's, set by an admin), the template's
    # own switches, and vLLM's explicit budget, which overrides the tier's.
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    thinking_token_budget: Annotated[int, Field(ge=0, le=MAX_THINKING_TOKENS)] | None = None

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
    echo: Annotated[bool, BeforeValidator(_refuse("echo", "echo is not offered", allow=(False,)))] = False
    suffix: Annotated[None, BeforeValidator(_refuse("suffix", "insertion (suffix) is not offered"))] = None

    @property
    def limit(self) -> int | None:
        return self.max_tokens
