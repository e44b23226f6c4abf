"""The engine server's POST /v1/responses: the Responses API run as the chat it converts to (protocols/responses.py),
streamed as its typed events or answered whole. The engine server stores nothing: `previous_response_id` and
`background` are the platform's (which stores responses per tenant) and are refused here by name."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from loraplex.engine.errors import RequestError
from loraplex.engine.serve.api_errors import ApiError, ClientDisconnected, error_detail
from loraplex.engine.serve.protocol import ChatCompletionRequest
from loraplex.engine.serve.protocols.http import event_stream, written
from loraplex.engine.serve.protocols.responses import (
    ResponsesRequest,
    ResponseStream,
    new_response_id,
    response_of,
    sse,
    to_chat,
)
from loraplex.engine.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

Serving = NamedDependency[OpenAIServing]


def _chat(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise RequestError(
            "this engine server stores no responses: send the whole conversation in input (the platform stores "
            "them and takes previous_response_id)",
            param="previous_response_id",
        )
    if body.background:
        raise RequestError(
            "background responses are the platform's; this engine server answers at once", param="background"
        )
    if body.unknown_fields:
        logger.info("responses: ignoring fields %s", ", ".join(body.unknown_fields))
    chat = to_chat(body)
    if body.stream:
        # The usage once, at the end (all the response object needs): a running usage costs ~50 us a chunk.
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return ChatCompletionRequest.model_validate(chat)


class _Writer:
    def __init__(self, events: ResponseStream) -> None:
        self.events = events

    def feed(self, chunk: dict[str, Any]) -> str:
        return "".join(sse(event) for event in self.events.feed(chunk))

    def end(self) -> str:
        return "".join(sse(event) for event in self.events.end())

    def failed(self, exc: BaseException) -> str:
        _, detail = error_detail(exc)
        return sse(self.events.failed(detail.message, detail.code))


class ResponsesController(Controller):
    path = "/v1"
    tags = ["openai"]

    @post("/responses", status_code=200, summary="Create a model response (OpenAI's Responses API)")
    async def responses(
        self, data: JSONBody[ResponsesRequest], request: Request[Any, Any, Any], serving: Serving
    ) -> Response[Any]:
        chat = _chat(data)
        job = await serving.chat_job(chat)
        job.start(serving.engine)  # a full queue answers 503 here, before any byte
        response_id, model = new_response_id(), data.model or serving.model_name
        if data.stream:
            events = ResponseStream(data, response_id=response_id, model=model, store=False)
            return event_stream(job, written(job, serving.chat_stream(job, chat), _Writer(events)))
        try:
            answer = await serving.chat(job, chat, request)
        except ClientDisconnected:
            raise ApiError(499, "The client closed the connection.", code="aborted") from None
        finally:
            job.close()
        return Response(response_of(answer.model_dump(), data, response_id=response_id, model=model, store=False))
