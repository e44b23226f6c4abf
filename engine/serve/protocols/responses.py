"""OpenAI's Responses API (what Codex CLI and the Agents SDK send) as the engine's chat: the request shape, its
conversion into a chat request (engine/serve/protocol.py's fields, as a dict), and the chat's answer and stream
chunks (dicts) back into a response object and its typed stream events.

Mapping, both ways:
- `instructions` is the system message; `input` a string (one user message) or items: messages (`role` user,
  system, developer or assistant; content a string or `input_text` / `output_text` parts), `function_call` items
  (an assistant turn's tool calls; consecutive ones join the assistant turn before them), `function_call_output`
  items (tool messages answering their `call_id`), and `reasoning` items passed back (accepted, left out of the
  prompt as chat templates leave earlier reasoning out). Images, files, item references and built-in tools' items
  are a 400 naming their type.
- `tools` of type `function`, and those inside a `namespace` (whose calls then name it), are chat's functions
  (`strict` is honoured: `required`/named calls are held to their schemas by the structured-output engine, as
  chat's are). Built-in tools the engine does not run (web search, file search, computer use, shells, MCP, custom
  grammars) are left out of what the model is told, not refused: agent clients send them on every request
  (decision 0048). `tool_choice` and `parallel_tool_calls` go across; `text.format` is chat's `response_format`;
  `reasoning.effort` the reasoning tier (the thinking budget); `max_output_tokens`, `temperature`, `top_p`,
  `top_logprobs` (logprobs of the output text), `user` as chat's.
- Output items: a `reasoning` item with the think block as `reasoning_text` content, a `message` with one
  `output_text` part, a `function_call` per call (`call_id` the chat call's id). `status` is `completed`, or
  `incomplete` with `incomplete_details.reason` `max_output_tokens`. Usage in the Responses API's names, the
  prefix-cache hits as `input_tokens_details.cached_tokens`.
- Streaming: `response.created`, `response.in_progress`, per item `response.output_item.added`, its part and
  deltas (`response.output_text.delta` / `.done` inside `response.content_part.added` / `.done`,
  `response.reasoning_text.delta` / `.done`, `response.function_call_arguments.delta` / `.done`) and
  `response.output_item.done`, then `response.completed` (or `response.incomplete`) with the whole response; every
  event numbered by `sequence_number`. A failure after the start is `response.failed`.

The request and its conversion live in responses_request.py, whose names this module exports too; the answer and
the stream are here. State (`store`, `previous_response_id`, retrieval) is the caller's: the platform stores
responses per tenant and hands their items back as input (`items_of` writes a response's output as the input items
that continue it).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from loraplex.engine.serve.protocols.responses_request import (
    FunctionChoice,
    FunctionTool,
    ReasoningConfig,
    ResponsesRequest,
    TextConfig,
    TextFormat,
    chat_messages,
    functions,
    namespaces,
    to_chat,
)

# The request's names are this module's too: callers read one module for the protocol.
__all__ = [
    "FunctionChoice",
    "FunctionTool",
    "ReasoningConfig",
    "ResponseStream",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "chat_messages",
    "envelope",
    "functions",
    "items_of",
    "namespaces",
    "new_response_id",
    "response_of",
    "sse",
    "to_chat",
]


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str | None, status: str = "completed", logprobs: Any = None) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed", namespace: str | None = None
) -> dict[str, Any]:
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _logprobs(choice_logprobs: Any) -> list[dict[str, Any]]:
    """Chat's logprobs content as the Responses API's (token, logprob, bytes, top_logprobs)."""
    if not isinstance(choice_logprobs, dict):
        return []
    return [
        {
            "token": entry.get("token", ""),
            "logprob": entry.get("logprob", 0.0),
            "bytes": entry.get("bytes") or [],
            "top_logprobs": [
                {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0), "bytes": t.get("bytes") or []}
                for t in entry.get("top_logprobs") or []
            ],
        }
        for entry in choice_logprobs.get("content") or []
    ]


def envelope(
    body: ResponsesRequest,
    *,
    response_id: str,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    store: bool,
) -> dict[str, Any]:
    """The response object around `output`, echoing the request's settings as OpenAI's does."""
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    )
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "text": {"format": text_format or {"type": "text"}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "metadata": body.metadata or {},
        "user": body.user,
        "store": store,
        "previous_response_id": body.previous_response_id,
        "usage": usage,
    }


def response_of(
    answer: dict[str, Any], body: ResponsesRequest, *, response_id: str, model: str, store: bool
) -> dict[str, Any]:
    """The response to a (non-streamed) chat `answer`."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        output.append(
            _message_item(_item_id("msg"), message.get("content") or "", logprobs=_logprobs(choice.get("logprobs")))
        )
    spaces = namespaces(body)
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name = function.get("name", "")
        output.append(
            _call_item(_item_id("fc"), call["id"], name, function.get("arguments", ""), namespace=spaces.get(name))
        )
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    return envelope(
        body,
        response_id=response_id,
        model=model,
        created_at=int(answer.get("created") or time.time()),
        status=status,
        output=output,
        usage=_usage(answer.get("usage")),
        store=store,
    )


def items_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the input items that continue its conversation (what `previous_response_id` adds)."""
    items = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or [])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
    return items


class ResponseStream:
    """The Responses API's stream events of a chat stream: `feed` each chat chunk (a dict, with its running usage),
    then `end`; each returns the events it makes. `response` is the whole response once it has ended."""

    def __init__(self, body: ResponsesRequest, *, response_id: str, model: str, store: bool) -> None:
        self._body, self._id, self._model, self._store = body, response_id, model, store
        self._created = int(time.time())
        self._sequence = 0
        self._started = False
        self._items: list[dict[str, Any]] = []  # the output so far; the last may be open
        self._open: str | None = None  # the type of the open item
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self.response: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self, status: str) -> dict[str, Any]:
        return envelope(
            self._body,
            response_id=self._id,
            model=self._model,
            created_at=self._created,
            status=status,
            output=[dict(item) for item in self._items],
            usage=_usage(self._usage) if status != "in_progress" else None,
            store=self._store,
        )

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if not self._started:
            self._started = True
            snapshot = self._snapshot("in_progress")
            events += [self._event("response.created", response=snapshot)]
            events += [self._event("response.in_progress", response=snapshot)]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._open_item("reasoning")
                item = self._items[-1]
                item["content"][0]["text"] += delta["reasoning_content"]
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=item["id"],
                        output_index=len(self._items) - 1,
                        content_index=0,
                        delta=delta["reasoning_content"],
                    )
                )
            if delta.get("content"):
                events += self._open_item("message")
                item = self._items[-1]
                item["content"][0]["text"] += delta["content"]
                logprobs = _logprobs(choice.get("logprobs"))
                item["content"][0]["logprobs"] += logprobs
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=len(self._items) - 1,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=logprobs,
                    )
                )
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    events += self._open_item("function_call", call_id=call["id"], name=function.get("name") or "")
                arguments = function.get("arguments")
                if arguments and self._open == "function_call":
                    item = self._items[-1]
                    item["arguments"] += arguments
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=len(self._items) - 1,
                            delta=arguments,
                        )
                    )
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return events

    def end(self) -> list[dict[str, Any]]:
        events = self._close_item()
        if not self._items:  # an empty answer is still a message, as the whole response has one
            events += self._open_item("message") + self._close_item()
        status = "incomplete" if self._finish == "length" else "completed"
        self.response = self._snapshot(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.response)]

    def failed(self, message: str, code: str | None) -> dict[str, Any]:
        """The `response.failed` event of a stream that broke after it began."""
        snapshot = self._snapshot("failed")
        snapshot["error"] = {"code": code or "server_error", "message": message}
        return self._event("response.failed", response=snapshot)

    def _open_item(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        if self._open == kind and kind != "function_call":
            return []
        events = self._close_item()
        if kind == "reasoning":
            item = _reasoning_item(_item_id("rs"), "", status="in_progress")
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        elif kind == "message":
            item = _message_item(_item_id("msg"), None, status="in_progress")
        else:
            name = fields["name"]
            spaces = namespaces(self._body)
            item = _call_item(
                _item_id("fc"), fields["call_id"], name, "", status="in_progress", namespace=spaces.get(name)
            )
        self._items.append(item)
        self._open = kind
        index = len(self._items) - 1
        events.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=dict(item, content=[]) if kind != "function_call" else dict(item),
            )
        )
        if kind == "message":
            item["content"] = [_text_part("")]
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        return events

    def _close_item(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, index, kind = self._items[-1], len(self._items) - 1, self._open
        self._open = None
        events = []
        if kind == "message":
            text = item["content"][0]["text"]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=item["content"][0]["logprobs"],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=item["content"][0],
                )
            )
        elif kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events


def sse(event: dict[str, Any]) -> str:
    """OpenAI's framing of a Responses event: its type as the SSE event name, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
