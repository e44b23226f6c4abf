"""OpenAI's wire shapes for the engine server: /v1/completions, /v1/chat/completions and /v1/models, and vLLM's
for /v1/load_lora_adapter and /v1/unload_lora_adapter.

Requests accept OpenAI's fields plus vLLM's sampling extras (top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, include_stop_str_in_output), vLLM's `cache_salt` and `stream_options.continuous_usage_stats`,
vLLM's `chat_template_kwargs` and `thinking_token_budget` and OpenAI's `reasoning_effort` (reasoning models), and one
field of our own for a trusted caller (the platform): `lora_adapter`, an adapter named by its files and content
digest (`LoraAdapterSpec`). Unknown fields are ignored, as both servers do, and listed in `model_extra` so the
server can log them. Shape errors (a wrong type, a role that does not exist) fail validation and name the field;
values the engine cannot honour (best_of, suffix, the legacy functions API, a request's own chat template, template
variables the server sets itself) are refused by `sampling_params()` / `check_supported()` with a `RequestError`
naming the field; ranges (temperature, penalties, n, ...) are `SamplingParams`'s to check, and output grammars
(`response_format`, `tool_choice`, vLLM's `guided_*` and `structured_outputs`) the engine's grammar compiler's, so
each rule lives in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
    model_serializer,
)

from loraplex.engine.core.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from loraplex.engine.errors import RequestError
from loraplex.engine.serve.chat_messages import ChatMessage
from loraplex.engine.serve.kv_transfer import KVTransferParams
from loraplex.engine.serve.logprobs import ChoiceLogprobs, CompletionLogprobs
from loraplex.engine.serve.lora_spec import LoraAdapterSpec
from loraplex.engine.serve.output_formats import ResponseFormat, StructuredOutputsField
from loraplex.engine.serve.tool_calls import (
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
    WithoutNulls,
    required_grammar,
)

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
# Variables the server gives a chat template itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token", "unk_token", "pad_token"}
)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit

# Completions' `prompt`: one text, one token-id list, or a batch of either (one choice per prompt).
Prompt = str | list[int] | list[str] | list[list[int]]


def completion_limit(max_completion_tokens: int | None, max_tokens: int | None) -> int | None:
    """The completion's token limit of a chat request: `max_completion_tokens`, else the older `max_tokens` (OpenAI
    deprecated it for the former; both are accepted, and the newer wins when both are given)."""
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def _unsupported(param: str, message: str) -> RequestError:
    return RequestError(message, code="unsupported_value", param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = False
    # vLLM's: every chunk carries the usage so far (and the closing usage chunk comes too, as if include_usage),
    # so a caller relaying chunks knows what it has handed out when its own client goes away.
    continuous_usage_stats: StrictBool | None = False


# OpenAI's service tiers as scheduler priorities (lower is served first, vLLM's convention).
SERVICE_TIER_PRIORITY: dict[str, int] = {"priority": -1, "default": 0, "flex": 1}


class _SamplingFields(_Request):
    """Fields both APIs share, mapped to SamplingParams in one place."""

    model: str | None = None  # vLLM's leniency: absent means the served model
    n: StrictInt | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    lora_adapter: LoraAdapterSpec | None = None  # ours (see LoraAdapterSpec); `model` is then the base model
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (the platform sets one per
    # tenant; a client that reaches the engine directly can only narrow its own sharing with it).
    cache_salt: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    repetition_penalty: float | None = None
    # vLLM's structured outputs: the older guided_* fields and the newer structured_outputs object
    guided_json: Any = (
        None  # a schema (object) or its JSON text: StructuredOutputsParams checks which, naming the field
    )
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's priority (lower first), OpenAI's service tier (its priority when `priority` is not given); ours: whose
    # request this is (fair share; `user` when absent), and its weight
    priority: StrictInt = 0
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    fairness_key: Annotated[str, StringConstraints(max_length=256)] | None = None
    fairness_weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    # vLLM's disaggregated prefill and decode (engine/serve/kv_transfer.py): pin the prompt's blocks for a decode
    # engine, or fetch them from a prefill engine (or a peer's cache) first.
    kv_transfer_params: KVTransferParams | None = None

    @property
    def share_key(self) -> str:
        return self.fairness_key if self.fairness_key is not None else (self.user or "")

    @property
    def resolved_service_tier(self) -> str:
        return "default" if self.service_tier in (None, "auto") else str(self.service_tier)

    @property
    def effective_priority(self) -> int:
        """`priority` when given, else the service tier's: flex below default below priority."""
        if "priority" in self.model_fields_set:
            return self.priority
        return SERVICE_TIER_PRIORITY[self.resolved_service_tier]

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        # Checked before pydantic's union, whose errors would name each alternative (`stop.str`, `stop.list[str]`).
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(value)}")
        return value

    @property
    def include_usage(self) -> bool:
        """A stream ends with a chunk carrying the whole usage (continuous usage implies it)."""
        options = self.stream_options
        return bool(self.stream and options is not None and (options.include_usage or options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        """Every chunk of the stream carries the usage so far."""
        options = self.stream_options
        return bool(self.stream and options is not None and options.continuous_usage_stats)

    def check_supported(self) -> None:
        """Refuse what the engine cannot do rather than silently ignoring it."""

    def output_grammar(self) -> StructuredOutputsParams | None:
        """The one grammar the request's fields ask for (None for free text); RequestError if several do."""
        asked: list[StructuredOutputsParams] = []
        if self.guided_json is not None:
            asked.append(StructuredOutputsParams(json=self.guided_json, param="guided_json"))
        if self.guided_regex is not None:
            asked.append(StructuredOutputsParams(regex=self.guided_regex, param="guided_regex"))
        if self.guided_choice is not None:
            asked.append(StructuredOutputsParams(choice=self.guided_choice, param="guided_choice"))
        if self.guided_grammar is not None:
            asked.append(StructuredOutputsParams(grammar=self.guided_grammar, param="guided_grammar"))
        if (so := self.structured_outputs) is not None:
            asked.append(
                StructuredOutputsParams(
                    json=so.json_,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=bool(so.json_object),
                    param="structured_outputs",
                )
            )
        asked.extend(self._format_grammar())
        if len(asked) > 1:
            names = ", ".join(a.param for a in asked)
            raise RequestError(f"ask for one output format, not several ({names})", param=asked[1].param)
        return asked[0] if asked else None

    def _format_grammar(self) -> list[StructuredOutputsParams]:
        return []

    def _sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, float]
    ) -> SamplingParams:
        """The engine's parameters; a field the request leaves out takes the checkpoint's default (its
        generation_config.json), else the API's. SamplingParams raises RequestError naming any out-of-range field."""
        self.check_supported()

        def pick(name: str, value: float | None, fallback: float) -> float:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n if self.n is not None else 1,
            presence_penalty=self.presence_penalty if self.presence_penalty is not None else 0.0,
            frequency_penalty=self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            logit_bias=self.logit_bias,
            structured_outputs=self.output_grammar(),
            temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=int(pick("top_k", self.top_k, 0)),
            min_p=pick("min_p", self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# --- /v1/completions ---------------------------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = 16  # OpenAI's default for this API
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # One check with one message: pydantic's own error for a four-way union lists every alternative.
        def is_ids(item: Any) -> bool:
            return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

        ok = isinstance(value, str) or (
            isinstance(value, list)
            and len(value) > 0
            and (is_ids(value) or all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value))
        )
        if not ok:
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per choice, in choice order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(token, int) for token in prompt):
            return [cast("list[int]", prompt)]
        batch: list[str | list[int]] = []
        batch.extend(cast("list[str] | list[list[int]]", prompt))
        return batch

    def sampling_params(self, defaults: Mapping[str, float] = MappingProxyType({})) -> SamplingParams:
        if self.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of must be 1")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise _unsupported("echo", "echo cannot be combined with logprobs (prompt logprobs are not supported)")
        return self._sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs, defaults=defaults)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id that ended the choice


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (billed apart)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens of think blocks (their markers and forced closing text included)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    @classmethod
    def of(
        cls,
        *,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_cached_tokens: int,
        num_reasoning_tokens: int = 0,
    ) -> Usage:
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=num_reasoning_tokens),
        )


class _Answer(BaseModel):
    """What every answer and chunk of both APIs carries besides its choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None
    service_tier: str | None = None


class _Transfer(BaseModel):
    """An answer with vLLM's `kv_transfer_params` (a prefill engine's pinned blocks), left out of the JSON when there
    are none, so an answer's shape is OpenAI's unless its request asked for a transfer."""

    @model_serializer(mode="wrap")
    def _without_absent_transfer(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("kv_transfer_params") is None:
            data.pop("kv_transfer_params", None)
        return data


class CompletionResponse(_Answer, _Transfer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


# A stream's chunks have the same shape as the response (OpenAI's object is "text_completion" for both).
CompletionChunk = CompletionResponse


# --- /v1/chat/completions ----------------------------------------------------------------------------------------


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: further variables for the model's chat template
    add_generation_prompt: StrictBool = True
    # OpenAI's effort tier: the thinking-token budget of a reasoning model (the engine's --reasoning-budgets), and a
    # variable of the chat template; vLLM's thinking_token_budget sets the budget itself.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = None

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto (the model decides; OpenAI's default with tools), required
        (one call at least) or named (a call of `tool_choice`'s function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools or ())

    def tool_grammar(self) -> StructuredOutputsParams | None:
        """The output grammar `required` or a named function calls for."""
        mode = self.tool_mode
        if mode == "required":
            functions = [(t.function.name, t.function.arguments_schema) for t in self.tools or ()]
            return required_grammar(functions, parallel=self.parallel_tool_calls is not False)
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            name = self.tool_choice.function.name
            tool = next((t for t in self.tools or () if t.function.name == name), None)
            if tool is None:
                raise RequestError(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
            return StructuredOutputsParams(
                json=tool.function.arguments_schema, param=f"tools[{name}].function.parameters"
            )
        return None

    def _format_grammar(self) -> list[StructuredOutputsParams]:
        """`response_format` as a grammar: OpenAI's json_object and json_schema; or the calls tool_choice forces,
        which leave this turn no message for a response format to shape (as OpenAI's: an agent that calls a tool
        first and answers in its format afterwards sends both on every turn)."""
        tools = self.tool_grammar()
        if tools is not None:
            return [tools]
        return self._response_format_grammar()

    def _response_format_grammar(self) -> list[StructuredOutputsParams]:
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return []
        if response_format.type == "json_object":
            return [StructuredOutputsParams(json_object=True, param="response_format")]
        spec = response_format.json_schema
        if spec is None:
            raise RequestError("response_format of type json_schema needs its json_schema", param="response_format")
        schema = spec.schema_ if spec.schema_ is not None else {}  # OpenAI's default: any JSON (an empty schema)
        return [StructuredOutputsParams(json=schema, param="response_format.json_schema.schema")]

    def check_supported(self) -> None:
        if self.functions or self.function_call not in (None, "none"):
            name = "functions" if self.functions else "function_call"
            raise _unsupported(name, "the legacy functions API is not supported: send tools and tool_choice")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", code="invalid_value", param="tool_choice")
        if self.chat_template is not None:
            raise _unsupported(
                "chat_template", "a request may not supply its own chat template; the model's template is used"
            )
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise RequestError(
                f"chat_template_kwargs may not set '{reserved[0]}': the server sets it from the request",
                code="invalid_value",
                param="chat_template_kwargs",
            )

    def sampling_params(self, defaults: Mapping[str, float] = MappingProxyType({})) -> SamplingParams:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", code="invalid_value", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = completion_limit(self.max_completion_tokens, self.max_tokens)
        params = self._sampling_params(max_tokens=limit, logprobs=logprobs, defaults=defaults)
        if self.thinking_token_budget is None:
            return params
        return dataclasses.replace(params, thinking_token_budget=self.thinking_token_budget)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's further variables: chat_template_kwargs, and `reasoning_effort` (as vLLM passes it);
        `none` also turns thinking off where the template reads Qwen3's `enable_thinking`, unless the caller set it."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":
                variables.setdefault("enable_thinking", False)
        return variables

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as HF chat templates take them (OpenAI's shape), unless tool_choice is none."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's think block, without its markers (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Answer, _Transfer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(WithoutNulls):
    """OpenAI's deltas carry only what changed: `{"content": "..."}`, and `{}` on the finishing chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) ----------------------------------------------------


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str  # a folder PEFT's save_pretrained wrote, or s3://bucket/prefix holding the same two files


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str


# --- /v1/models -------------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplex"
    root: str | None = None  # vLLM's: the base model's name, or an adapter's source (folder or s3:// URI)
    parent: str | None = None  # vLLM's: an adapter's base model; None for the base model itself
    max_model_len: int
    # The base model's parameters, and those one token runs (fewer on a mixture-of-experts base); None on adapters.
    parameters: int | None = None
    active_parameters: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
