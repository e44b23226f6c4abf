"""Litestar dependencies and guards: the only place request handling reaches into process resources."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.auth import AdminPrincipal, TenantPrincipal
from loraplex.platform.resources import Resources


def resources_of(state: State) -> Resources:
    resources: Resources = state.resources
    return resources


async def provide_resources(state: State) -> Resources:
    return resources_of(state)


async def provide_db(state: State) -> AsyncGenerator[AsyncSession, None]:
    """A session per request. Handlers commit what they write; anything uncommitted is rolled back here."""
    async with resources_of(state).sessions() as session:
        yield session


async def require_tenant(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    authenticator = resources_of(connection.app.state).authenticator
    connection.state.principal = await authenticator.tenant(connection.headers.get("authorization"))


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    authenticator = resources_of(connection.app.state).authenticator
    connection.state.admin = await authenticator.admin(connection.headers.get("authorization"))


async def provide_principal(request: ASGIConnection[Any, Any, Any, Any]) -> TenantPrincipal:
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
