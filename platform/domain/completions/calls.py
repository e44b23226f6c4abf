"""What every tenant call to a model goes through before its engine is asked (completions and embeddings alike):
its lookups (`Prepare`: model, terms, tier, a replica), then one admission round trip (rate limits, the
configuration generation, the tenant's concurrency lease); and the watch on its client's connection, so that a
client that gave up stops its engine request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from litestar import Request as HttpRequest
from litestar import Response
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.concurrency import HeldLease, concurrency_error
from loraplex.platform.config_cache import Basis
from loraplex.platform.dependencies import tenant_credentials
from loraplex.platform.domain.completions.lookups import TenantTerms
from loraplex.platform.domain.completions.service import Call
from loraplex.platform.errors import ApiError, openai_error
from loraplex.platform.ratelimit import rate_limit_error
from loraplex.platform.resources import Resources

# nginx's "client closed request": never seen by the client, but honest in access logs.
STATUS_CLIENT_CLOSED = 499
MAX_BODY_BYTES = 4 * 2**20

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a request's lookups gave, before its admission."""

    principal: TenantPrincipal
    call: Call
    terms: TenantTerms
    tokens: int  # the rate limits' estimate


# The lookups of one call, made for the principal given (the request's key, authenticated again when the tables
# changed while it was admitted); raises the refusals they make.
Prepare = Callable[[TenantPrincipal], Awaitable[Prepared]]


async def admit(
    request: HttpRequest[Any, Any, Any],
    resources: Resources,
    principal: TenantPrincipal,
    prepare: Prepare,
    basis: Basis | None,
) -> tuple[Call, dict[str, str], HeldLease]:
    """Everything that can refuse the request, before any byte is sent: model, a replica, limits, and last its
    tenant's concurrency lease, which the caller owns from here on (and must release when the request ends).

    The cached lookups (the key's, in the guard, and `prepare`'s: the rest of them, for the principal it is given) are
    made before the configuration generation is read (decision 0038): the admission reads it in its round trip, and
    decides nothing if it is not the generation the lookups were made in (`basis`). They are then made again, after
    adopting the generation read, as a request that read it first makes them; so is a refusal by the lookups whose
    generation is no longer the store's."""
    cache = resources.config_cache
    while True:
        try:
            prepared = await prepare(principal)
        except ApiError:
            if basis is None or await cache.verify(basis):
                raise
            basis, principal = None, await _again(request, resources)
            continue
        if basis is not None and not cache.holds(basis):  # emptied while it looked: look again, after a read
            await cache.sync()
            basis, principal = None, await _again(request, resources)
            continue
        admission = await resources.admitter.admit(
            tenant_id=str(principal.tenant_id),
            key_id=principal.key_id,
            tenant=prepared.terms.limits,
            key=prepared.terms.key_limits,
            tokens=prepared.tokens,
            cap=prepared.terms.max_concurrent_requests,
            generation=None if basis is None else basis.token,
        )
        if admission.stale:
            cache.adopt(admission.generation)
            basis, principal = None, await _again(request, resources)
            continue
        break
    assert admission.rate is not None
    lease = admission.lease.lease if admission.lease is not None else None
    if basis is not None and admission.generation is None:
        # The store did not answer (the failure policy decided): what came from the tables cannot be confirmed, so
        # it is read from the database, as when the generation cannot be read first.
        cache.adopt(None)
        try:
            prepared = await prepare(await _again(request, resources))
        except BaseException:
            if lease is not None:
                await HeldLease(resources.leases, lease).release()
            raise
    if not admission.rate.allowed:
        raise rate_limit_error(admission.rate)
    if lease is None:
        assert admission.lease is not None
        raise concurrency_error(admission.lease)
    call = prepared.call
    # The request id is the usage row's key: a client can find what it was billed even if it got no chunk.
    return call, {**admission.rate.headers, "x-request-id": call.request_id}, HeldLease(resources.leases, lease)


async def _again(request: HttpRequest[Any, Any, Any], resources: Resources) -> TenantPrincipal:
    """The request's key, authenticated again after the tables changed (the generation was read since it began)."""
    return await resources.authenticator.tenant(tenant_credentials(request), sync=False)


async def unwatch(gone: asyncio.Future[None]) -> None:
    if gone.done():  # already unwatched (`unless_disconnected` does), or the client left: nothing to wait for
        return
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)


async def disconnected(request: HttpRequest[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(gone: asyncio.Future[None], work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, cancelling it (which aborts the engine request) if the client goes away first (`gone`, the
    watcher of its connection, completes): a client that gave up (a timeout, then a retry) must not leave its
    generation running to max_tokens."""
    task = asyncio.ensure_future(work)
    waiting: set[asyncio.Future[Any]] = {task, gone}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise client_closed()
        return task.result()
    finally:
        task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


def client_closed() -> ApiError:
    return ApiError(STATUS_CLIENT_CLOSED, "The client closed the connection.", code="client_closed")


def too_large(_: HttpRequest[Any, Any, Any], __: RequestEntityTooLarge) -> Response[dict[str, Any]]:
    """The handlers' answer to a body over MAX_BODY_BYTES."""
    return openai_error(
        413,
        f"The request body is larger than {MAX_BODY_BYTES} bytes, the most this API accepts.",
        code="request_too_large",
    )
