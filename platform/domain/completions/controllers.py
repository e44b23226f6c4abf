"""HTTP for tenant completions: POST /v1/chat/completions, POST /v1/completions, GET /v1/models and
GET /v1/models/{model}."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from litestar import Controller, Response, get, post
from litestar import Request as HttpRequest
from litestar.background_tasks import BackgroundTask
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import JSONBody
from litestar.response import Stream

from loraplex.engine import CheckpointError
from loraplex.engine.serve import messages
from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.concurrency import HeldLease
from loraplex.platform.config_cache import Basis
from loraplex.platform.dependencies import GENERATION_CHECKED_LATER, AppResources, Principal, config_basis
from loraplex.platform.domain.adapters.service import ready_adapter_ref
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.completions.calls import (
    MAX_BODY_BYTES,
    Prepared,
    admit,
    client_closed,
    disconnected,
    too_large,
    unless_disconnected,
    unwatch,
)
from loraplex.platform.domain.completions.lookups import model_not_found
from loraplex.platform.domain.completions.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.domain.completions.service import (
    Call,
    Request,
    engine_body,
    engine_error,
    estimate_tokens,
    new_request_id,
    record_usage,
    record_usage_soon,
    relay,
    resolve,
    resolve_service_tier,
    route,
    tenant_terms,
)
from loraplex.platform.domain.embeddings.schemas import EmbeddingRequest
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.domain.endpoints.repository import EndpointRepository
from loraplex.platform.domain.endpoints.service import EndpointService
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources

SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


class Framing:
    """How a completion is written for its client's protocol: this class, OpenAI's chat and completions as the
    engine writes them; a subclass per other protocol (platform/domain/messages: Anthropic's), one per request."""

    running_usage = False  # the protocol reads each chunk's running usage (`Call.running_usage`)

    def request_id(self, chat: bool) -> str:
        return new_request_id(chat)

    def headers(self, call: Call) -> dict[str, str]:
        return {}

    async def answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The whole answer, from the chat or completion assembled from the engine's stream (a protocol that
        stores its answers stores it here, before it is sent)."""
        return answer

    def chunk(self, event: dict[str, Any]) -> str:
        """The stream's text for one engine chunk (rewritten for the client already)."""
        return _sse(event)

    def error(self, error: ApiError) -> str:
        """The stream's text for a failure after it began."""
        return _sse({"error": {"message": error.message, "type": "server_error", "param": None, "code": error.code}})

    async def done(self) -> str:
        """The stream's end, once every chunk went out (a protocol that stores its answers stores it here)."""
        return SSE_DONE


OPENAI = Framing()


async def prepare_completion(
    resources: Resources, principal: TenantPrincipal, body: Request, path: str, framing: Framing
) -> Prepared:
    """What the request's cached lookups decide, before its admission: model, terms, tier, a replica. Raises the
    refusals they make. (A background response's run calls it alone: it was admitted when it was created.)"""
    target = await resolve(resources, principal, body.model)
    terms = await tenant_terms(resources, principal)
    service_tier = resolve_service_tier(body.service_tier, terms.service_tiers)
    source = ready_adapter_ref(resources, target.adapter).uri if target.adapter is not None else None
    # Built first: it refuses what the target cannot take (a thinking budget for a model that does not reason)
    # whether or not an engine serves it now.
    sent = engine_body(
        target,
        body,
        source,
        # The tenant's prefix-cache salt: derived from the deployment's secret, never from the request, and not
        # the tenant id itself (anyone who reaches an engine and knows an id could otherwise probe that cache).
        cache_salt=resources.hasher.derive("prefix-cache-salt", str(principal.tenant_id)),
        fairness_key=str(principal.tenant_id),
        fairness_weight=terms.fairness_weight,
        service_tier=service_tier,
    )
    choice = await route(resources, principal, target, body)
    if choice is None:
        raise ApiError(
            503, f"No engine serves '{target.base_model.name}' right now; retry shortly.", code="engine_unavailable"
        )
    call = Call(
        request_id=framing.request_id(isinstance(body, ChatCompletionRequest)),
        running_usage=framing.running_usage,
        principal=principal,
        target=target,
        body=body,
        replica=choice.replica,
        engine_body=sent,
        path=path,
        service_tier=service_tier,
        warm_peer=choice.warm_peer,
    )
    return Prepared(principal, call, terms, estimate_tokens(body, choice.replica.max_model_len))


async def complete(
    request: HttpRequest[Any, Any, Any],
    resources: Resources,
    principal: TenantPrincipal,
    body: Request,
    path: str,
    basis: Basis | None = None,
    framing: Framing = OPENAI,
) -> Response[Any]:
    """Answer a completion of `principal`, written as `framing` writes it. `basis`: what its key's lookup relied on,
    when the configuration generation was not read before it (`Authenticator.tenant_checked_later`); None when it
    was."""
    # Watched from the start: a client that gave up while this request waited (on a slow database, say) has gone
    # before the engine is asked, and then nothing runs.
    gone = asyncio.ensure_future(disconnected(request))
    try:
        call, headers, lease = await admit_completion(request, resources, principal, body, path, basis, framing)
    except BaseException:
        await unwatch(gone)
        raise
    # The lease is held until the request ends: released here when that is before a stream starts (without
    # waiting for the store once the answer is complete), else by the stream (when it ends, fails, or its client
    # leaves).
    try:
        response = await _answer(resources, call, headers, gone, lease, framing)
    except BaseException:
        await lease.release()
        raise
    if not isinstance(response, Stream):
        resources.admitter.release_soon(lease)
    return response


async def admit_completion(
    request: HttpRequest[Any, Any, Any],
    resources: Resources,
    principal: TenantPrincipal,
    body: Request,
    path: str,
    basis: Basis | None,
    framing: Framing,
) -> tuple[Call, dict[str, str], HeldLease]:
    """Everything that can refuse a completion (`admit`), for a caller that answers it its own way (a background
    response): the call, its response headers, and the concurrency lease it now owns."""
    call, headers, lease = await admit(
        request, resources, principal, lambda p: prepare_completion(resources, p, body, path, framing), basis
    )
    headers |= framing.headers(call)
    return call, headers, lease


async def _answer(
    resources: Resources,
    call: Call,
    headers: dict[str, str],
    gone: asyncio.Future[None],
    lease: HeldLease,
    framing: Framing,
) -> Response[Any]:
    """The answer to an admitted request; `gone` watches its client until a stream (which watches it itself)
    begins."""
    body = call.body
    assert not isinstance(body, EmbeddingRequest), "embeddings are answered by embeddings/controllers.py"
    try:
        if gone.done():
            await record_usage(resources, call)  # cancelled, zero tokens: the request id is accounted for
            raise client_closed()
        if not body.stream:
            try:
                answer = await unless_disconnected(gone, collect(resources, call))
            except BaseException:
                await record_usage(resources, call)
                raise
            record_usage_soon(resources, call)
            return Response(await framing.answer(answer), headers=headers)
    finally:
        # A stream is watched by Litestar's Stream from here on: this watcher must not take its messages.
        await unwatch(gone)
    # The engine validates the request before its first event (a prompt too long, a bad parameter): wait for that
    # first event, so such a request is a plain error response, not a 200 whose stream holds an error.
    events = relay(resources, call)
    try:
        first = await anext(events)
    except (EngineRequestError, EngineUnavailable) as exc:
        call.tally.status = "error"
        await record_usage(resources, call)
        raise engine_error(exc) from None
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        await record_usage(resources, call)
        raise
    if first is not None and "error" in first:  # failed before its first token (its adapter did not load)
        await events.aclose()
        await record_usage(resources, call)
        raise _failed(first["error"])
    body_stream = _stream(resources, call, events, first, lease, framing)
    return Stream(
        body_stream,
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        # Litestar does not close an iterator it stops reading (the client went away while a chunk was being
        # sent): closing it here ends the engine request and records the usage now, not when it is collected.
        background=BackgroundTask(_end_stream, body_stream, lease),
    )


async def _end_stream(body_stream: AsyncGenerator[str, None], lease: HeldLease) -> None:
    await body_stream.aclose()
    await lease.release()  # a stream never started has no finally to release it


async def _stream(
    resources: Resources,
    call: Call,
    events: AsyncGenerator[dict[str, Any], None],
    first: dict[str, Any] | None,
    lease: HeldLease,
    framing: Framing,
) -> AsyncGenerator[str, None]:
    """SSE to the client: `first` (already taken from `events`), then the rest; an engine failure mid-stream ends
    it with an error event. The lease is released before [DONE] is sent, so a client that sends its next request
    as soon as it reads [DONE] finds its slot free. Usage is recorded (and the lease released, if it was not yet)
    from the finally, whether the stream ended, failed, or the client went away; usage in a task of its own, so
    that a slow database never holds the end of a finished stream back."""
    try:
        try:
            if first is not None:  # the engine's first chat chunk carries the role delta
                yield framing.chunk(first)
                async for event in events:
                    yield framing.chunk(event)
        except (EngineRequestError, EngineUnavailable) as exc:
            call.tally.status = "error"
            yield framing.error(engine_error(exc))
        await events.aclose()
        await lease.release()
        yield await framing.done()
    finally:
        try:
            await events.aclose()
            record_usage_soon(resources, call)
        finally:
            await lease.release()


def _failed(error: dict[str, Any]) -> ApiError:
    """The engine failed the request after accepting it: our fault (its adapter is one we stored), not the client's."""
    return ApiError(502, str(error.get("message", "The engine failed the request.")), code=error.get("code"))


def _add_call_delta(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one streamed tool-call delta into the call of its index."""
    index = int(delta.get("index", 0))
    function = delta.get("function") or {}
    entry = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    entry["id"] = delta.get("id") or entry["id"]
    entry["function"]["name"] += function.get("name") or ""
    entry["function"]["arguments"] += function.get("arguments") or ""


@dataclass(slots=True)
class _Choice:
    """One choice of a non-streamed answer, as its streamed parts add up."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] | None = None  # chat: the think block's text, None until a delta carries some
    logprobs: list[Any] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool calls by index, arguments joined
    finish: str | None = None


async def collect(resources: Resources, call: Call) -> dict[str, Any]:
    """A non-streamed answer, assembled from the engine's stream (one choice per index, n of them)."""
    chat = isinstance(call.body, ChatCompletionRequest)
    choices: dict[int, _Choice] = {}
    try:
        async with contextlib.aclosing(relay(resources, call)) as events:
            async for event in events:
                if "error" in event:
                    raise _failed(event["error"])
                for part in event.get("choices") or []:
                    choice = choices.setdefault(int(part.get("index", 0)), _Choice())
                    delta = part.get("delta") or {}
                    piece = delta.get("content") if chat else part.get("text")
                    choice.text.append(piece or "")
                    thought = delta.get("reasoning_content")
                    if isinstance(thought, str):
                        if choice.reasoning is None:
                            choice.reasoning = []
                        choice.reasoning.append(thought)
                    for tool_call in delta.get("tool_calls") or []:
                        _add_call_delta(choice.calls, tool_call)
                    if part.get("logprobs"):
                        choice.logprobs.append(part["logprobs"])
                    choice.finish = part.get("finish_reason") or choice.finish
    except (EngineRequestError, EngineUnavailable) as exc:
        call.tally.status = "error"
        raise engine_error(exc) from None
    usage = call.tally.usage()
    created = int(time.time())
    ordered = [(index, choices[index]) for index in sorted(choices)]
    if chat:
        answers = []
        for index, choice in ordered:
            text, calls, logprobs = choice.text, choice.calls, choice.logprobs
            merged = {"content": [t for lp in logprobs for t in (lp.get("content") or [])]} if logprobs else None
            message = {
                "role": "assistant",
                "content": "".join(text) if text and (any(text) or not calls) else None,
                "reasoning_content": None if choice.reasoning is None else "".join(choice.reasoning),
                "tool_calls": [calls[i] for i in sorted(calls)],
            }
            answers.append({"index": index, "message": message, "logprobs": merged, "finish_reason": choice.finish})
        return {
            "id": call.request_id,
            "object": "chat.completion",
            "created": created,
            "model": call.target.model,
            "choices": answers,
            "usage": usage,
            "service_tier": call.service_tier.value,
        }
    texts = []
    for index, choice in ordered:
        completion_logprobs = None
        if choice.logprobs:
            completion_logprobs = {
                key: [v for lp in choice.logprobs for v in lp.get(key, [])]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        texts.append(
            {
                "index": index,
                "text": "".join(choice.text),
                "logprobs": completion_logprobs,
                "finish_reason": choice.finish,
            }
        )
    return {
        "id": call.request_id,
        "object": "text_completion",
        "created": created,
        "model": call.target.model,
        "choices": texts,
        "usage": usage,
        "service_tier": call.service_tier.value,
    }


class CompletionsController(Controller):
    path = "/"
    tags = ["tenant: completions"]

    @post(
        "/chat/completions",
        status_code=200,  # OpenAI answers 200, not Litestar's default 201 for a POST
        summary="Chat completion (OpenAI's API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: too_large},
        opt={GENERATION_CHECKED_LATER: True},
    )
    async def chat(
        self,
        request: HttpRequest[Any, Any, Any],
        data: JSONBody[ChatCompletionRequest],
        principal: Principal,
        resources: AppResources,
    ) -> Response[Any]:
        return await complete(request, resources, principal, data, "/v1/chat/completions", config_basis(request))

    @post(
        "/completions",
        status_code=200,  # OpenAI answers 200, not Litestar's default 201 for a POST
        summary="Text completion (OpenAI's legacy API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: too_large},
        opt={GENERATION_CHECKED_LATER: True},
    )
    async def completions(
        self,
        request: HttpRequest[Any, Any, Any],
        data: JSONBody[CompletionRequest],
        principal: Principal,
        resources: AppResources,
    ) -> Response[Any]:
        return await complete(request, resources, principal, data, "/v1/completions", config_basis(request))

    @get(
        "/models",
        summary="Models you can name: your endpoints and the base models (Anthropic's shape with anthropic-version)",
    )
    async def models(
        self, request: HttpRequest[Any, Any, Any], principal: Principal, resources: AppResources
    ) -> dict[str, Any]:
        async with resources.sessions() as session:
            base_models = await BaseModelRepository(session).list()
            endpoints = await EndpointService(session).list_all(principal.tenant_id)
        data = [_endpoint_card(e) for e in endpoints] + [await _base_model_card(b, resources) for b in base_models]
        if messages.ANTHROPIC_VERSION_HEADER in request.headers:  # Claude Code and the anthropic SDKs list models so
            return messages.anthropic_model_list([(card["id"], card["created"]) for card in data])
        return {"object": "list", "data": data}

    @get("/models/{model_id:path}", summary="One model you can name (the SDK's models.retrieve)")
    async def model(self, model_id: str, principal: Principal, resources: AppResources) -> dict[str, Any]:
        name = model_id.lstrip("/")
        async with resources.sessions() as session:
            endpoint = await EndpointRepository(session).get_by_name(name, principal.tenant_id)
            if endpoint is not None:
                return _endpoint_card(endpoint)
            base = await BaseModelRepository(session).get_by_name(name)
        if base is None:
            raise model_not_found(name)
        return await _base_model_card(base, resources)


def _endpoint_card(endpoint: Endpoint) -> dict[str, Any]:
    created = int(endpoint.created_at.timestamp())
    return {"id": endpoint.name, "object": "model", "created": created, "owned_by": "you", "kind": "endpoint"}


async def _base_model_card(base: BaseModel, resources: AppResources) -> dict[str, Any]:
    """A base model's card, with its parameters and those one token runs (fewer on a mixture-of-experts base), from
    its config.json; without them when the checkpoint cannot be read just now (the listing still answers)."""
    created = int(base.created_at.timestamp())
    card: dict[str, Any] = {
        "id": base.name,
        "object": "model",
        "created": created,
        "owned_by": "loraplex",
        "kind": "base_model",
    }
    try:
        config = await resources.model_configs.of(base.source)
    except CheckpointError:
        return card
    return {**card, "parameters": config.num_parameters(), "active_parameters": config.active_parameters()}
