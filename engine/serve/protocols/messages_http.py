"""The engine server's Anthropic routes: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens,
run as the chat they convert to (protocols/messages.py), with every error in Anthropic's envelope and a
`request-id` header, as Anthropic's API answers."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from loraplex.engine.errors import EngineOverloaded
from loraplex.engine.serve.api_errors import ApiError, ClientDisconnected, error_detail
from loraplex.engine.serve.protocol import ChatCompletionRequest
from loraplex.engine.serve.protocols.http import event_stream, written
from loraplex.engine.serve.protocols.messages import (
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    error_body,
    message_of,
    new_message_id,
    sse,
    to_chat,
)
from loraplex.engine.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

Serving = NamedDependency[OpenAIServing]
REQUEST_ID_HEADER = "request-id"


def anthropic_error(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Any exception of these routes (validation, a guard's, the engine's) in Anthropic's envelope."""
    status_code, detail = error_detail(exc, request)
    status_code, body = error_body(status_code, detail.message, overloaded=isinstance(exc, EngineOverloaded))
    headers = {REQUEST_ID_HEADER: _request_id()}
    if isinstance(exc, EngineOverloaded):
        headers["Retry-After"] = str(exc.retry_after_s)
    return Response(body, status_code=status_code, headers=headers)


def _request_id() -> str:
    return "req_" + secrets.token_hex(12)


def _chat(serving: OpenAIServing, body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    if body.unknown_fields:
        logger.info("messages: ignoring fields %s", ", ".join(body.unknown_fields))
    chat = to_chat(body, reasoning_model=serving.engine.core.config.reasoning is not None)
    if isinstance(body, MessagesRequest) and body.stream:
        # The usage once, at the end; message_start has the prompt's size from the job (a running usage would cost
        # ~50 us a chunk).
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return ChatCompletionRequest.model_validate(chat)


class _Writer:
    def __init__(self, events: MessageStream) -> None:
        self.events = events

    def feed(self, chunk: dict[str, Any]) -> str:
        return "".join(sse(name, data) for name, data in self.events.feed(chunk))

    def end(self) -> str:
        return "".join(sse(name, data) for name, data in self.events.end())

    def failed(self, exc: BaseException) -> str:
        status_code, detail = error_detail(exc)
        return sse("error", error_body(status_code, detail.message, overloaded=isinstance(exc, EngineOverloaded))[1])


class MessagesController(Controller):
    path = "/v1"
    tags = ["anthropic"]
    exception_handlers = {Exception: anthropic_error}

    @post("/messages", status_code=200, summary="Create a message (Anthropic's Messages API)")
    async def messages(
        self, data: JSONBody[MessagesRequest], request: Request[Any, Any, Any], serving: Serving
    ) -> Response[Any]:
        chat = _chat(serving, data)
        job = await serving.chat_job(chat)
        job.start(serving.engine)  # a full queue answers 529 here, before any byte
        message_id, model = new_message_id(), data.model or serving.model_name
        headers = {REQUEST_ID_HEADER: _request_id()}
        stops = data.stop_sequences or []
        if data.stream:
            prompt_tokens = len(job.prompt_of(0).checked.token_ids)
            events = MessageStream(
                message_id=message_id, model=model, stop_sequences=stops, prompt_tokens=prompt_tokens
            )
            return event_stream(job, written(job, serving.chat_stream(job, chat), _Writer(events)), headers)
        try:
            answer = await serving.chat(job, chat, request)
        except ClientDisconnected:
            raise ApiError(499, "The client closed the connection.", code="aborted") from None
        finally:
            job.close()
        message = message_of(answer.model_dump(), message_id=message_id, model=model, stop_sequences=stops)
        return Response(message, headers=headers)

    @post("/messages/count_tokens", status_code=200, summary="Count a message's input tokens (Anthropic's API)")
    async def count_tokens(self, data: JSONBody[CountTokensRequest], serving: Serving) -> Response[dict[str, int]]:
        tokens = await serving.count_chat_tokens(_chat(serving, data))
        return Response({"input_tokens": tokens}, headers={REQUEST_ID_HEADER: _request_id()})
