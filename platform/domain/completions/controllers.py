"""HTTP for tenant completions: POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Response, get, post
from litestar.params import JSONBody
from litestar.response import Stream

from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.dependencies import AppResources, Principal
from loraplex.platform.domain.adapters.service import ready_adapter_ref
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.completions.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.domain.completions.service import (
    Call,
    Request,
    check_adapter,
    engine_body,
    engine_error,
    estimate_tokens,
    limits_for,
    new_request_id,
    record_usage,
    relay,
    resolve,
)
from loraplex.platform.domain.endpoints.repository import EndpointRepository
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.errors import ApiError
from loraplex.platform.ratelimit import rate_limit_error
from loraplex.platform.resources import Resources

SSE_DONE = "data: [DONE]\n\n"
MAX_BODY_BYTES = 4 * 2**20


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _start(
    resources: Resources, principal: TenantPrincipal, body: Request, path: str
) -> tuple[Call, dict[str, str]]:
    """Everything that can refuse the request, before any byte is sent: model, limits, a replica."""
    target = await resolve(resources, principal, body.model)
    check_adapter(target)
    tenant_limits, key_limits = await limits_for(resources, principal)
    decision = await resources.rate_limiter.acquire(
        tenant_id=str(principal.tenant_id),
        key_id=principal.key_id,
        tenant=tenant_limits,
        key=key_limits,
        tokens=estimate_tokens(body),
    )
    if not decision.allowed:
        raise rate_limit_error(decision)
    digest = target.adapter.digest if target.adapter is not None else None
    affinity = f"{principal.tenant_id}:{body.prompt_cache_key or ''}"
    replica = await resources.router.pick(target.base_model.name, digest, affinity)
    if replica is None:
        raise ApiError(
            503, f"No engine serves '{target.base_model.name}' right now; retry shortly.", code="engine_unavailable"
        )
    source = ready_adapter_ref(resources, target.adapter)[0] if target.adapter is not None else None
    call = Call(
        request_id=new_request_id(isinstance(body, ChatCompletionRequest)),
        principal=principal,
        target=target,
        body=body,
        replica=replica,
        engine_body=engine_body(target, body, source),
        path=path,
    )
    return call, decision.headers


async def _complete(resources: Resources, principal: TenantPrincipal, body: Request, path: str) -> Response[Any]:
    call, headers = await _start(resources, principal, body, path)
    if body.stream:
        return Stream(_stream(resources, call), media_type="text/event-stream", headers=headers)
    try:
        return Response(await _collect(resources, call), headers=headers)
    finally:
        await record_usage(resources, call)


async def _stream(resources: Resources, call: Call) -> AsyncIterator[str]:
    """SSE to the client; an engine failure mid-stream ends it with an error event. Usage is recorded in the
    finally, shielded, whether the stream ended, failed, or the client went away."""
    try:
        async for event in relay(resources, call):  # the engine's first chat chunk carries the role delta
            yield _sse(event)
        yield SSE_DONE
    except (EngineRequestError, EngineUnavailable) as exc:
        call.tally.status = "error"
        error = engine_error(exc)
        yield _sse({"error": {"message": error.message, "type": "server_error", "param": None, "code": error.code}})
        yield SSE_DONE
    finally:
        await record_usage(resources, call)


async def _collect(resources: Resources, call: Call) -> dict[str, Any]:
    """A non-streamed answer, assembled from the engine's stream."""
    chat = isinstance(call.body, ChatCompletionRequest)
    text: list[str] = []
    logprobs: list[Any] = []
    finish: str | None = None
    try:
        async for event in relay(resources, call):
            if "error" in event:
                raise ApiError(502, str(event["error"].get("message", "engine error")), code=event["error"].get("code"))
            for part in event.get("choices") or []:
                piece = (part.get("delta") or {}).get("content") if chat else part.get("text")
                text.append(piece or "")
                if part.get("logprobs"):
                    logprobs.append(part["logprobs"])
                finish = part.get("finish_reason") or finish
    except (EngineRequestError, EngineUnavailable) as exc:
        call.tally.status = "error"
        raise engine_error(exc) from None
    tally = call.tally
    usage = {
        "prompt_tokens": tally.prompt_tokens,
        "completion_tokens": tally.completion_tokens,
        "total_tokens": tally.prompt_tokens + tally.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": tally.cached_tokens},
    }
    created = int(time.time())
    if chat:
        merged = {"content": [t for lp in logprobs for t in (lp.get("content") or [])]} if logprobs else None
        answer: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(text)},
            "logprobs": merged,
            "finish_reason": finish,
        }
        return {
            "id": call.request_id,
            "object": "chat.completion",
            "created": created,
            "model": call.target.model,
            "choices": [answer],
            "usage": usage,
        }
    completion_logprobs = None
    if logprobs:
        completion_logprobs = {
            key: [v for lp in logprobs for v in lp.get(key, [])]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
    return {
        "id": call.request_id,
        "object": "text_completion",
        "created": created,
        "model": call.target.model,
        "choices": [{"index": 0, "text": "".join(text), "logprobs": completion_logprobs, "finish_reason": finish}],
        "usage": usage,
    }


class CompletionsController(Controller):
    path = "/"
    tags = ["tenant: completions"]

    @post("/chat/completions", summary="Chat completion (OpenAI's API)", request_max_body_size=MAX_BODY_BYTES)
    async def chat(
        self, data: JSONBody[ChatCompletionRequest], principal: Principal, resources: AppResources
    ) -> Response[Any]:
        return await _complete(resources, principal, data, "/v1/chat/completions")

    @post("/completions", summary="Text completion (OpenAI's legacy API)", request_max_body_size=MAX_BODY_BYTES)
    async def completions(
        self, data: JSONBody[CompletionRequest], principal: Principal, resources: AppResources
    ) -> Response[Any]:
        return await _complete(resources, principal, data, "/v1/completions")

    @get("/models", summary="Models you can name: your endpoints and the base models")
    async def models(self, principal: Principal, resources: AppResources) -> dict[str, Any]:
        async with resources.sessions() as session:
            base_models = await BaseModelRepository(session).list()
            endpoints = await EndpointRepository(session).list_for_tenant(principal.tenant_id, limit=100, after=None)
        data = [
            {
                "id": e.name,
                "object": "model",
                "created": int(e.created_at.timestamp()),
                "owned_by": "you",
                "kind": "endpoint",
            }
            for e in endpoints.items
        ]
        data += [
            {
                "id": b.name,
                "object": "model",
                "created": int(b.created_at.timestamp()),
                "owned_by": "loraplex",
                "kind": "base_model",
            }
            for b in base_models
        ]
        return {"object": "list", "data": data}
