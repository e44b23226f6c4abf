"""Litestar dependencies and guards: the only place request handling reaches into process resources."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.auth import AdminPrincipal, TenantPrincipal
from loraplex.platform.config_cache import Basis
from loraplex.platform.resources import Resources


def resources_of(state: State) -> Resources:
    resources: Resources = state.resources
    return resources


async def provide_resources(state: State) -> Resources:
    return resources_of(state)


async def provide_db(state: State) -> AsyncGenerator[AsyncSession, None]:
    """A session per request. Handlers commit what they write; anything uncommitted is rolled back here. A commit
    that changed what requests cache (keys, tenants, endpoints, adapters, base models) is published to every
    replica here, before the response goes out (decision 0035)."""
    resources = resources_of(state)
    async with resources.sessions() as session:
        try:
            yield session
        finally:
            await resources.config_cache.publish_changes(session)


# A handler's `opt` flag: it checks its cached lookups against the configuration generation when it reads it, after
# them (completions read it in their admission's round trip), so its key is authenticated without reading it first.
GENERATION_CHECKED_LATER = "generation_checked_later"


def tenant_credentials(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The request's Authorization header, or its key as Anthropic's clients send it (`x-api-key`) as a bearer."""
    authorization = connection.headers.get("authorization")
    if authorization is None and (key := connection.headers.get("x-api-key")):
        return f"Bearer {key}"
    return authorization


async def require_tenant(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    authenticator = resources_of(connection.app.state).authenticator
    authorization = tenant_credentials(connection)
    if handler.opt.get(GENERATION_CHECKED_LATER):
        connection.state.principal, connection.state.config_basis = await authenticator.tenant_checked_later(
            authorization
        )
        return
    connection.state.principal = await authenticator.tenant(authorization)


def config_basis(connection: ASGIConnection[Any, Any, Any, Any]) -> Basis | None:
    """What the lookups of a GENERATION_CHECKED_LATER handler's request rely on (`ConfigCache.basis`); None: the
    generation was read before them."""
    basis: Basis | None = connection.state.config_basis
    return basis


# Admin pages a browser may open: without a bearer token (which browsers never send) they open in the console,
# which signs the browser in first.
CONSOLE_PAGES = {"/admin/billing": "/console/admin/billing"}


class OpenInConsole(Exception):
    """A browser asked for an admin page without a credential: send it to the page's console twin."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location


def open_in_console(_: Request[Any, Any, Any], exc: OpenInConsole) -> Redirect:
    return Redirect(exc.location, status_code=303)


def _console_twin(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    if connection.scope.get("method") != "GET" or "text/html" not in connection.headers.get("accept", ""):
        return None
    twin = CONSOLE_PAGES.get(connection.url.path.rstrip("/"))
    if twin is None:
        return None
    return twin + (f"?{connection.url.query}" if connection.url.query else "")


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    if "authorization" not in connection.headers and (twin := _console_twin(connection)) is not None:
        raise OpenInConsole(twin)
    authenticator = resources_of(connection.app.state).authenticator
    connection.state.admin = await authenticator.admin(connection.headers.get("authorization"))


async def provide_principal(request: ASGIConnection[Any, Any, Any, Any], resources: AppResources) -> TenantPrincipal:
    """The principal `require_tenant` authenticated. It names `resources` only to be resolved after it: Litestar
    resolves the dependencies of one level of a handler's graph concurrently, in a task group of their own for
    every request, and that costs more per request than the two of them resolved one after the other."""
    del resources
    principal: TenantPrincipal = request.state.principal
    return principal


async def provide_admin(request: ASGIConnection[Any, Any, Any, Any]) -> AdminPrincipal:
    admin: AdminPrincipal = request.state.admin
    return admin


# What handlers declare: `db: DbSession`, `resources: AppResources`, `principal: Principal`. Named explicitly
# because Litestar 3 drops dependency inference by parameter name.
DbSession = NamedDependency[AsyncSession]
AppResources = NamedDependency[Resources]
Principal = NamedDependency[TenantPrincipal]
AdminCaller = NamedDependency[AdminPrincipal]
