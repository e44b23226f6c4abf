"""Tool calling for the chat API: which grammar a `tool_choice` puts on the output, and how a model's text becomes
OpenAI's `message.tool_calls`.

- `tool_choice: "required"` constrains the output to a JSON array of one or more calls (`[{"name": ..., "parameters":
  {...}}]`, at most one with `parallel_tool_calls: false`), each call's parameters held to its function's schema;
  a named function constrains the output to that function's arguments. Either way the text is the call, parsed here.
- `tool_choice: "auto"` leaves the model free; a parser chosen per model (vLLM's `--tool-call-parser`) finds the
  calls in what it wrote: `hermes` (Hermes, Qwen 2.5 and 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
  or `llama3_json` (Llama 3.1-3.3: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
  separated by `;`). Text that holds no well-formed call is content, as vLLM leaves it.
- The wire shapes: the tools a request offers (`ToolDefinition`, `NamedToolChoice`), the calls in messages
  (`ToolCall`) and in stream deltas (`DeltaToolCall`).
- Streaming (`ToolCallStream`): content goes out as it comes until the text may be starting a call; from there the
  text is held back, and the calls are sent once complete, each as one delta with its id, name and arguments, which
  the `openai` SDK's stream helpers assemble as they do OpenAI's.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictStr,
    StringConstraints,
    model_serializer,
)

from loraplex.engine.core.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS: Final = ("hermes", "llama3_json")
_HERMES_START: Final = "<tool_call>"
_HERMES_CALL: Final = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PYTHON_TAG: Final = "<|python_tag|>"


# --- wire shapes ---------------------------------------------------------------------------------------------------

FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule (dots: vLLM's)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: FunctionName
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call the assistant made, in an earlier turn (request) or this one (response)."""

    model_config = ConfigDict(extra="allow")

    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        # HF chat templates render `arguments` with `tojson` and expect the object, as vLLM hands it to them.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; absent: no arguments
    strict: StrictBool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class WithoutNulls(BaseModel):
    """A shape serialized without its unset (None) fields, as OpenAI's stream deltas are."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class DeltaFunctionCall(WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(WithoutNulls):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


# --- parsing -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def wire(self) -> ToolCall:
        """As a message's `tool_calls` entry."""
        return ToolCall(id=self.id, type="function", function=FunctionCall(name=self.name, arguments=self.arguments))


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call format calls for, when it has one we know."""
    if not chat_template:
        return None
    if _HERMES_START in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


def required_grammar(
    functions: Sequence[tuple[str, dict[str, Any]]], *, parallel: bool, param: str = "tools"
) -> StructuredOutputsParams:
    """`tool_choice: "required"`: a JSON array of calls of these (name, parameters schema) functions."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, param=param)


def parse_required(text: str) -> list[ParsedToolCall]:
    """The calls of an output made under `required_grammar` (an empty list if it was cut short)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    if not isinstance(calls, list):
        return []
    return [_call(c.get("name"), c.get("parameters")) for c in calls if isinstance(c, dict) and _is_call(c)]


def _is_call(value: dict[str, Any]) -> bool:
    return isinstance(value.get("name"), str) and isinstance(value.get("parameters"), dict)


def _call(name: Any, arguments: Any) -> ParsedToolCall:
    return ParsedToolCall(new_call_id(), str(name), json.dumps(arguments, ensure_ascii=False))


def parse_auto(parser: str, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a free output; calls of functions not in `names` are left in the content."""
    if parser == "hermes":
        start = text.find(_HERMES_START)
        if start == -1:
            return text, []
        calls: list[ParsedToolCall] = []
        for match in _HERMES_CALL.finditer(text, start):
            call = _json_object(match.group(1))
            if call is None or call.get("name") not in names or not isinstance(call.get("arguments", {}), dict):
                return text, []  # one malformed call and the whole text is content, as vLLM's parser does
            calls.append(_call(call["name"], call.get("arguments", {})))
        content = text[:start].rstrip()
        return (content or None), calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for piece in _split_objects(body):
        call = _json_object(piece)
        arguments = call.get("parameters", call.get("arguments")) if call is not None else None
        if call is None or call.get("name") not in names or not isinstance(arguments, dict):
            return text, []
        calls.append(_call(call["name"], arguments))
    return None, calls


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _split_objects(text: str) -> list[str]:
    """`{...}; {...}` (Llama 3's way of writing several calls) as its objects' texts."""
    decoder = json.JSONDecoder()
    pieces: list[str] = []
    index = 0
    while index < len(text):
        try:
            _, end = decoder.raw_decode(text, index)
        except ValueError:
            return [text]
        pieces.append(text[index:end])
        index = end
        while index < len(text) and text[index] in " \n\t;":
            index += 1
    return pieces


class ToolCallStream:
    """Splits a streamed `auto` output into content deltas and, at the end, its calls (see the module doc)."""

    def __init__(self, parser: str, names: frozenset[str]) -> None:
        self.parser = parser
        self.names = names
        self._text = ""
        self._sent = 0  # characters of content already sent
        self._held = False  # a call may have begun: nothing more goes out as content

    def feed(self, delta: str) -> str:
        """The content that may go out now, given the new text."""
        self._text += delta
        if self._held:
            return ""
        start = self._call_start()
        if start is not None:
            self._held = True
            out, self._sent = self._text[self._sent : start], start
            return out
        safe = len(self._text) - self._partial_marker()
        out, self._sent = self._text[self._sent : safe], max(self._sent, safe)
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The content still to send, and the calls; with no calls all held text is content."""
        content, calls = parse_auto(self.parser, self._text, self.names)
        if not calls:
            rest, self._sent = self._text[self._sent :], len(self._text)
            return rest, []
        return (content or "")[self._sent :] if content else "", calls

    def _call_start(self) -> int | None:
        if self.parser == "hermes":
            index = self._text.find(_HERMES_START)
            return index if index != -1 else None
        stripped = self._text.lstrip()
        if stripped.startswith(("{", _PYTHON_TAG)):
            return 0
        return None

    def _partial_marker(self) -> int:
        """How many characters at the end could be the start of a call marker."""
        if self.parser == "hermes":
            marker = _HERMES_START
        elif not self._text.strip():
            return len(self._text)  # only whitespace so far: a JSON call may still follow
        else:
            marker = _PYTHON_TAG if self._text.lstrip().startswith("<") else ""
        for length in range(min(len(marker) - 1, len(self._text)), 0, -1):
            if self._text.endswith(marker[:length]):
                return length
        return 0
