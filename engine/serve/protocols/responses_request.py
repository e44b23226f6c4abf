"""The Responses API's request (OpenAI's shape, what Codex CLI and the Agents SDK send) and its conversion into the
engine's chat request; responses.py writes the chat's answer back (its module docstring gives the whole mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from loraplex.engine.errors import RequestError

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # summary, generate_summary

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # truncation, safety_identifier, prompt_cache_key...: accepted

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: StrictBool = False
    background: StrictBool | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        return value

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def to_chat(body: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The chat request `body` asks for (without `stream`), continuing `history` (the input items of the responses
    before it, and their output, oldest first: the caller's store). RequestError (a 400) for what the engine cannot
    do as asked."""
    chat: dict[str, Any] = {"messages": chat_messages(body, list(history))}
    if body.model is not None:
        chat["model"] = body.model
    if body.tools:
        chat["tools"] = functions(body)
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice) else choice
        )
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        if text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            schema: dict[str, Any] = {"name": text_format.name or "output", "schema": text_format.schema_ or {}}
            if text_format.strict is not None:
                schema["strict"] = text_format.strict
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "user"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.top_logprobs is not None:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    return chat


def chat_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation: `instructions`, then `history`'s items, then `body.input`'s."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for index, item in enumerate([*history, *items]):
        where = f"input[{index - len(history)}]" if index >= len(history) else "previous_response_id"
        _add_item(messages, item, where)
    return messages


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"content parts of type '{kind}' are not supported by this server (it takes input_text and"
                " output_text)",
                param=f"{where}.content[{index}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise RequestError("an input item must be an object", param=where)
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise RequestError(
            f"input items of type '{kind}' are not supported by this server (it takes messages, function_call,"
            " function_call_output and reasoning items)",
            param=f"{where}.type",
        )
    if kind == "reasoning":
        return  # passed back: accepted, not part of the prompt
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(f"role must be one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        return
    if kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(arguments, str)):
            raise RequestError("a function_call item needs call_id, name and arguments (strings)", param=where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            if not last.get("content"):
                last["content"] = None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError("a function_call_output item needs the call_id it answers", param=f"{where}.call_id")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("a function tool needs its name", param=f"{where}.name")
    parameters = tool.get("parameters")
    function: dict[str, Any] = {
        "name": name,
        "parameters": parameters if parameters is not None else {"type": "object"},
    }
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_tree(body: ResponsesRequest) -> list[tuple[str | None, dict[str, Any], str]]:
    """Every function tool of the request as (its namespace or None, the tool, where it is), namespaces' tools
    included; the built-in tools the engine does not run (web search, file search, computer use, code interpreter,
    image generation, shells, MCP servers, custom grammars) are left out: the model is not told of them."""
    found: list[tuple[str | None, dict[str, Any], str]] = []
    for index, tool in enumerate(body.tools or ()):
        raw = tool.model_dump(exclude_none=True)
        if tool.type == "function":
            found.append((None, raw, f"tools[{index}]"))
        elif tool.type == "namespace":
            for inner_index, inner in enumerate(raw.get("tools") or []):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    found.append((tool.name, inner, f"tools[{index}].tools[{inner_index}]"))
    return found


def functions(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's function tools as chat's (namespaces' tools by their own names)."""
    return [_function(tool, where) for _, tool, where in _tool_tree(body)]


def namespaces(body: ResponsesRequest) -> dict[str, str]:
    """The namespace of each namespaced function, by the function's name: its calls say it."""
    return {str(tool["name"]): namespace for namespace, tool, _ in _tool_tree(body) if namespace is not None}
