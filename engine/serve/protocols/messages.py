"""Anthropic's Messages API (what Claude Code and the anthropic SDKs send) as the engine's chat: the request shape,
its conversion into a chat request (engine/serve/protocol.py's fields, as a dict), and the chat's answer and stream
chunks (dicts, as the engine's server and the platform both have them) back into Anthropic's message and events.

Mapping, both ways:
- `system` (a string or text blocks) is the system message, and so is a message of role `system` (instructions
  mid-conversation, as Claude Code sends them); a user turn's `text` blocks are its text parts and each
  `tool_result` block a `tool` message answering its `tool_use_id` (an error's text prefixed "Error: "); an
  assistant turn's `text` is its content and its `tool_use` blocks its tool calls. `thinking` and
  `redacted_thinking` blocks passed back are accepted and left out of the prompt (chat templates drop earlier
  turns' reasoning too). `cache_control` is accepted anywhere: the prefix cache needs no marks. Any other block
  (`image`, `document`, server tools' results) is a 400 naming its type; so is a last assistant turn (prefill),
  which chat templates cannot continue.
- `tools` are functions (`input_schema` their parameters); `tool_choice` auto/any/tool/none is chat's
  auto/required/named/none, `disable_parallel_tool_use` its `parallel_tool_calls: false`. Server tools (a `type`
  other than `custom`: web search, code execution) are left out of what the model is told, as the Responses
  API's built-in tools are (decision 0048).
- `thinking` `enabled` sets the thinking-token budget to `budget_tokens` (which must be below `max_tokens`, as
  Anthropic's API requires), `disabled` a budget of 0 (and `enable_thinking: false` for the template),
  `adaptive` leaves the tier's; `output_config.effort` is the tier (`xhigh` and `max` are the engine's `high`:
  the largest budget it has, never more). Thinking asked of a model served without a reasoning parser is a 400.
  `output_config.format` is a `json_schema` response format.
- `stop_sequences`, `temperature`, `top_p`, `top_k`, `metadata.user_id` (chat's `user`) go across as they are.
- The answer's content is a `thinking` block (the think block's text; its `signature` is empty: the engine does not
  sign), a `text` block and a `tool_use` block per call; `stop_reason` is `tool_use`, `max_tokens`,
  `stop_sequence` (with the sequence) or `end_turn`. Usage in Anthropic's sense: `input_tokens` are the prompt
  tokens not read from the prefix cache, `cache_read_input_tokens` the ones that were, `cache_creation_input_tokens`
  0 (caching writes cost nothing extra here).
- Streaming: `message_start` (usage so far), `ping`, then per block `content_block_start`, its deltas
  (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason,
  cumulative usage) and `message_stop`; a failure after the start is an `error` event.
- Errors are Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`, by status; an overloaded
  engine is 529 `overloaded_error`.
"""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from loraplex.engine.errors import RequestError

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# Anthropic's effort levels as the engine's reasoning tiers (its largest is `high`).
EFFORT_TIERS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED_STATUS = 529
ANTHROPIC_VERSION_HEADER = "anthropic-version"  # sent by Anthropic's clients: GET /v1/models then answers in its shape


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, not needed


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: StrictBool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            _check_types(value, ("text",))
        return value

    def text(self) -> str:
        value = self.content
        body = value if isinstance(value, str) else "".join(block.text for block in value or ())
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


def _check_types(blocks: list[Any], allowed: tuple[str, ...]) -> None:
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise ValueError(
                f"content blocks of type '{kind}' are not supported by this server (it takes {', '.join(allowed)})"
            )


class InputMessage(BaseModel):
    role: Literal["user", "assistant", "system"]  # system: mid-conversation instructions, as Claude Code sends them
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if isinstance(value, list):
            _check_types(value, BLOCK_TYPES)
        return value

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, strict, input_examples

    type: str | None = None  # None or "custom": a function; anything else is a server tool
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")  # display

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=0)] | None = None


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`'s body (and the Messages request's fields but the output's)."""

    model_config = ConfigDict(extra="allow")  # container, service_tier, speed...: accepted, ignored

    model: str | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    metadata: Metadata | None = None
    stream: StrictBool = False


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


# --- request -----------------------------------------------------------------------------------------------------


def to_chat(body: CountTokensRequest, *, reasoning_model: bool) -> dict[str, Any]:
    """The chat request `body` asks for (engine/serve/protocol.py's fields), without `stream`; RequestError (a 400)
    for what the engine cannot do as asked. `reasoning_model`: the engine follows think blocks."""
    chat: dict[str, Any] = {"messages": _chat_messages(body)}
    if body.model is not None:
        chat["model"] = body.model
    tools = [tool for tool in body.tools or () if tool.type in (None, "custom")]  # server tools: left out
    if tools:
        chat["tools"] = [_function(tool) for tool in tools]
    _tool_choice(body, chat)
    _thinking(body, chat, reasoning_model)
    config = body.output_config
    if config is not None and config.format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": config.format.schema_, "strict": True},
        }
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, name)) is not None:
                chat[name] = value
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        if body.metadata is not None and body.metadata.user_id is not None:
            chat["user"] = body.metadata.user_id
    return chat


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        where = f"messages[{index}].content"
        if message.role == "user":
            messages.extend(_user_turn(message.blocks(), where))
        elif message.role == "system":
            messages.append({"role": "system", "content": _system_text(message.blocks(), where)})
        else:
            messages.append(_assistant_turn(message.blocks(), where))
    if body.messages[-1].role == "assistant":
        raise RequestError(
            "the last message is the assistant's: continuing a prefilled answer is not supported; end with a user "
            "message",
            param="messages",
        )
    return messages


def _system_text(blocks: list[Any], where: str) -> str:
    if not all(isinstance(block, TextBlock) for block in blocks):
        raise RequestError("a system message holds text blocks only", param=where)
    return "".join(block.text for block in blocks)


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if texts:
                turns.append({"role": "user", "content": texts})
                texts = []
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            raise RequestError(f"a user message holds text and tool_result blocks, not {block.type}", param=where)
    if texts or not turns:
        turns.append({"role": "user", "content": texts})
    return turns


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            raise RequestError("tool_result blocks belong in user messages", param=where)
        # thinking and redacted_thinking: accepted, not part of the prompt
    turn: dict[str, Any] = {"role": "assistant", "content": texts if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _function(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(body: CountTokensRequest, chat: dict[str, Any]) -> None:
    choice = body.tool_choice
    if choice is None:
        return
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice of type tool needs the tool's name", param="tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False


def _thinking(body: CountTokensRequest, chat: dict[str, Any], reasoning_model: bool) -> None:
    config, thinking = body.output_config, body.thinking
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = EFFORT_TIERS[config.effort]
    if thinking is None or thinking.type == "adaptive":
        return
    if thinking.type == "disabled":
        if reasoning_model:
            chat["thinking_token_budget"] = 0
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        return
    if not reasoning_model:
        raise RequestError(
            "thinking is not supported by this model: it is not served as a reasoning model", param="thinking"
        )
    if thinking.budget_tokens is None:
        raise RequestError("thinking of type enabled needs budget_tokens", param="thinking.budget_tokens")
    max_tokens = getattr(body, "max_tokens", None)
    if max_tokens is not None and thinking.budget_tokens >= max_tokens:
        raise RequestError("thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
    chat["thinking_token_budget"] = thinking.budget_tokens


# --- answer ------------------------------------------------------------------------------------------------------


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }


def _stop(choice: dict[str, Any], stop_sequences: list[str]) -> tuple[str, str | None]:
    finish = choice.get("finish_reason")
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    # The grammar of any/tool makes valid objects; a call the auto parser found holds what the model wrote.
    return value if isinstance(value, dict) else {"arguments": arguments}


def message_of(answer: dict[str, Any], *, message_id: str, model: str, stop_sequences: list[str]) -> dict[str, Any]:
    """The Messages API's answer to a (non-streamed) chat `answer`."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _tool_input(function.get("arguments") or ""),
            }
        )
    stop_reason, stop_sequence = _stop(choice, stop_sequences)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(answer.get("usage")),
    }


class MessageStream:
    """The Messages API's stream events of a chat stream: `feed` each chat chunk (a dict; its usage, running or at
    the end, is taken when it has one), then `end`; each returns the events it makes, as (event name, data)."""

    def __init__(self, *, message_id: str, model: str, stop_sequences: list[str], prompt_tokens: int = 0) -> None:
        """`prompt_tokens`: the prompt's size, for message_start when the chunks carry no running usage."""
        self._id, self._model, self._stop_sequences = message_id, model, stop_sequences
        self._started = False
        self._open: str | None = None  # the type of the block being streamed
        self._index = -1
        self._usage: dict[str, Any] | None = {"prompt_tokens": prompt_tokens} if prompt_tokens else None
        self._choice: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if not self._started:
            self._started = True
            message: dict[str, Any] = {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "model": self._model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(self._usage),
            }
            events += [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._block({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                events += self._block({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a call begins
                    block = {"type": "tool_use", "id": call["id"], "name": function.get("name") or "", "input": {}}
                    events += self._block(block, new=True)
                if function.get("arguments"):
                    events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason") is not None:
                self._choice = choice
        return events

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        stop_reason, stop_sequence = _stop(self._choice, self._stop_sequences)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(self._usage)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _block(self, block: dict[str, Any], *, new: bool = False) -> list[tuple[str, dict[str, Any]]]:
        if self._open == block["type"] and not new:
            return []
        events = self._close()
        self._index += 1
        self._open = block["type"]
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]


# --- errors ------------------------------------------------------------------------------------------------------


def error_body(status_code: int, message: str, *, overloaded: bool = False) -> tuple[int, dict[str, Any]]:
    """Anthropic's status and error envelope for an error of `status_code` (an overloaded engine: 529)."""
    if overloaded:
        status_code = OVERLOADED_STATUS
    kind = ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return status_code, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_model_list(models: list[tuple[str, int]]) -> dict[str, Any]:
    """GET /v1/models in Anthropic's shape, from (id, created unix seconds) pairs."""
    data = [
        {
            "type": "model",
            "id": model_id,
            "display_name": model_id,
            "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z"),
        }
        for model_id, created in models
    ]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
