"""HTTP for tenants' Anthropic clients (Claude Code, the anthropic SDKs): POST /v1/messages and
/v1/messages/count_tokens. A message is the tenant's chat completion (the same resolution of `model` to an endpoint
or adapter, limits, tiers, fair share, metering and billing) converted by the engine's Messages converter
(engine/serve/protocols/messages.py) and written back in Anthropic's shapes (`AnthropicFraming`); errors are
Anthropic's envelope (platform/errors.py, by path). The key is read from `x-api-key` (Anthropic's header) or
`Authorization: Bearer`."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, post
from litestar import Request as HttpRequest
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import JSONBody

from loraplex.engine import RequestError
from loraplex.engine.serve import messages as messages_api
from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.dependencies import GENERATION_CHECKED_LATER, AppResources, Principal, config_basis
from loraplex.platform.domain.completions.calls import MAX_BODY_BYTES
from loraplex.platform.domain.completions.controllers import Framing, complete
from loraplex.platform.domain.completions.lookups import Target
from loraplex.platform.domain.completions.service import Call, converted_chat, engine_error, resolve, route
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.errors import ApiError, anthropic_error, anthropic_request_id, invalid_request
from loraplex.platform.resources import Resources

CHAT_PATH = "/v1/chat/completions"


class AnthropicFraming(Framing):
    """A chat completion written as Anthropic's message and stream events, for one request."""

    running_usage = True  # message_start carries the prompt's usage, known from the first chunk

    def __init__(self, model: str, stop_sequences: list[str]) -> None:
        self.message_id = messages_api.new_message_id()
        self.model = model
        self.stop_sequences = stop_sequences
        self.events = messages_api.MessageStream(message_id=self.message_id, model=model, stop_sequences=stop_sequences)
        self.failed = False

    def request_id(self, chat: bool) -> str:
        return self.message_id  # the usage row's key is the message's id

    def headers(self, call: Call) -> dict[str, str]:
        return {"request-id": anthropic_request_id()}

    async def answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        return messages_api.message_of(
            answer, message_id=self.message_id, model=self.model, stop_sequences=self.stop_sequences
        )

    def chunk(self, event: dict[str, Any]) -> str:
        if "error" in event:  # the engine failed the request after accepting it (service.engine_failure)
            self.failed = True
            return messages_api.sse(
                "error", messages_api.error_body(500, str(event["error"].get("message", "The engine failed.")))[1]
            )
        return "".join(messages_api.sse(name, data) for name, data in self.events.feed(event))

    def error(self, error: ApiError) -> str:
        self.failed = True
        return messages_api.sse(
            "error", messages_api.error_body(error.status_code, error.message, overloaded=error.code == "overloaded")[1]
        )

    async def done(self) -> str:
        return "" if self.failed else "".join(messages_api.sse(name, data) for name, data in self.events.end())


def _too_large(_: HttpRequest[Any, Any, Any], __: RequestEntityTooLarge) -> Response[dict[str, Any]]:
    return anthropic_error(413, f"The request body is larger than {MAX_BODY_BYTES} bytes, the most this API accepts.")


async def _target(resources: Resources, principal: TenantPrincipal, model: str | None) -> Target:
    if not model:
        raise invalid_request("model: field required", param="model")
    return await resolve(resources, principal, model)


def _reasons(target: Target) -> bool:
    try:
        return target.base_model.reasoning() is not None
    except ValueError:  # stored valid; the chat path reports it (completions.service.thinking_budget)
        return True


def _converted(body: messages_api.CountTokensRequest, target: Target) -> dict[str, Any]:
    try:
        return messages_api.to_chat(body, reasoning_model=_reasons(target))
    except RequestError as exc:
        raise invalid_request(str(exc), param=exc.param) from None


class MessagesController(Controller):
    path = "/"
    tags = ["tenant: messages (Anthropic's API)"]

    @post(
        "/messages",
        status_code=200,
        summary="Create a message (Anthropic's Messages API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: _too_large},
        opt={GENERATION_CHECKED_LATER: True},
    )
    async def messages(
        self,
        request: HttpRequest[Any, Any, Any],
        data: JSONBody[messages_api.MessagesRequest],
        principal: Principal,
        resources: AppResources,
    ) -> Response[Any]:
        target = await _target(resources, principal, data.model)
        chat = _converted(data, target)
        if data.stream:
            chat |= {"stream": True, "stream_options": {"include_usage": True}}
        framing = AnthropicFraming(target.model, data.stop_sequences or [])
        return await complete(
            request, resources, principal, converted_chat(chat), CHAT_PATH, config_basis(request), framing
        )

    @post(
        "/messages/count_tokens",
        status_code=200,
        summary="Count a message's input tokens (Anthropic's API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: _too_large},
    )
    async def count_tokens(
        self, data: JSONBody[messages_api.CountTokensRequest], principal: Principal, resources: AppResources
    ) -> Response[dict[str, Any]]:
        """Counted by an engine serving the base model (the chat template is the base model's, adapter or not);
        free, as Anthropic's is."""
        target = await _target(resources, principal, data.model)
        chat = converted_chat(_converted(data, target) | {"model": target.model})  # the same bounds as a message's
        choice = await route(resources, principal, target, chat)
        if choice is None:
            raise ApiError(
                503, f"No engine serves '{target.base_model.name}' right now; retry shortly.", code="engine_unavailable"
            )
        sent = data.model_dump(exclude_none=True, by_alias=True) | {"model": target.base_model.name}
        try:
            counted = await resources.fleet.client(choice.replica).post("/v1/messages/count_tokens", sent)
        except (EngineRequestError, EngineUnavailable) as exc:
            raise engine_error(exc) from None
        return Response({"input_tokens": int(counted.get("input_tokens", 0))})
