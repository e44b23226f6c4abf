"""HTTP for tenant embeddings: POST /v1/embeddings (OpenAI's API), on an embedding base model or an endpoint on
one of its adapters. Admitted as completions are (limits, tier, concurrency lease), answered whole."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Controller, Response, post
from litestar import Request as HttpRequest
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import JSONBody

from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.config_cache import Basis
from loraplex.platform.dependencies import GENERATION_CHECKED_LATER, AppResources, Principal, config_basis
from loraplex.platform.domain.adapters.service import ready_adapter_ref
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
from loraplex.platform.domain.completions.service import (
    Call,
    engine_error,
    record_usage,
    record_usage_soon,
    resolve,
    resolve_service_tier,
    route,
    tenant_terms,
)
from loraplex.platform.domain.embeddings.schemas import EmbeddingRequest
from loraplex.platform.domain.embeddings.service import PATH, engine_body, estimate_tokens, fetch, new_request_id
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources


async def _prepare(resources: Resources, principal: TenantPrincipal, body: EmbeddingRequest) -> Prepared:
    target = await resolve(resources, principal, body.model)
    terms = await tenant_terms(resources, principal)
    service_tier = resolve_service_tier(None, terms.service_tiers)
    source = ready_adapter_ref(resources, target.adapter).uri if target.adapter is not None else None
    sent = engine_body(
        target,
        body,
        source,
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
        request_id=new_request_id(),
        principal=principal,
        target=target,
        body=body,
        replica=choice.replica,
        engine_body=sent,
        path=PATH,
        service_tier=service_tier,
    )
    return Prepared(principal, call, terms, estimate_tokens(body, choice.replica.max_model_len))


async def embed(
    request: HttpRequest[Any, Any, Any],
    resources: Resources,
    principal: TenantPrincipal,
    body: EmbeddingRequest,
    basis: Basis | None,
) -> Response[Any]:
    """Answer an embeddings request of `principal` (`basis`: as `completions.controllers.complete`'s)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        call, headers, lease = await admit(
            request, resources, principal, lambda key: _prepare(resources, key, body), basis
        )
    except BaseException:
        await unwatch(gone)
        raise
    try:
        if gone.done():
            await record_usage(resources, call)  # cancelled, zero tokens: the request id is accounted for
            raise client_closed()
        try:
            answer = await unless_disconnected(gone, fetch(resources, call))
        except (EngineRequestError, EngineUnavailable) as exc:
            call.tally.status = "error"
            await record_usage(resources, call)
            raise engine_error(exc) from None
        except BaseException:
            await record_usage(resources, call)
            raise
        record_usage_soon(resources, call)
        return Response(answer, headers=headers)
    finally:
        await unwatch(gone)
        resources.admitter.release_soon(lease)


class EmbeddingsController(Controller):
    path = "/"
    tags = ["tenant: embeddings"]

    @post(
        "/embeddings",
        status_code=200,  # OpenAI answers 200, not Litestar's default 201 for a POST
        summary="Create embeddings (an embedding model's, or an endpoint's on one; OpenAI's API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: too_large},
        opt={GENERATION_CHECKED_LATER: True},
    )
    async def embeddings(
        self,
        request: HttpRequest[Any, Any, Any],
        data: JSONBody[EmbeddingRequest],
        principal: Principal,
        resources: AppResources,
    ) -> Response[Any]:
        return await embed(request, resources, principal, data, config_basis(request))
