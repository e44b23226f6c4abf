"""Who is signed in to the console, checked on every request by the console routers' guards.

A request is let through when its cookie names a live session (sessions.py), the credential the session was opened
with is still in force (Authenticator.tenant_key_in_force / admin_in_force: a revoked key, a suspended tenant or a
changed admin token end it), the session's kind is the router's (tenant pages for tenants, admin pages for admins),
and an unsafe method carries the session's CSRF token. A session whose credential lapsed is deleted on the spot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler

from loraplex.platform.auth import AdminPrincipal, TenantPrincipal
from loraplex.platform.console.security import UNSAFE_METHODS, presented_csrf_token, session_cookie_name, tokens_match
from loraplex.platform.console.sessions import ConsoleSession, SessionKind
from loraplex.platform.dependencies import resources_of
from loraplex.platform.errors import ApiError


class SignInRequired(Exception):
    """No live session: a page answers with the sign-in form's address, a script with 401."""


@dataclass(frozen=True, slots=True)
class ConsoleCaller:
    """The signed-in browser of this request: its session and the principal it acts as."""

    session_id: str
    session: ConsoleSession
    tenant: TenantPrincipal | None  # set for tenant sessions
    admin: AdminPrincipal | None  # set for admin sessions

    @property
    def csrf_token(self) -> str:
        return self.session.csrf_token

    @property
    def is_admin(self) -> bool:
        return self.session.kind is SessionKind.ADMIN

    @property
    def principal(self) -> TenantPrincipal:
        """The tenant principal (only on tenant routers, whose guard guarantees one)."""
        if self.tenant is None:
            raise ApiError(403, "This page is for tenants: sign in with one of your API keys.", code="forbidden")
        return self.tenant


async def signed_in(connection: ASGIConnection[Any, Any, Any, Any]) -> ConsoleCaller | None:
    """The caller of a live session whose credential still holds, else None (a lapsed session is ended)."""
    resources = resources_of(connection.app.state)
    session_id = connection.cookies.get(session_cookie_name(resources.settings))
    if not session_id:
        return None
    session = await resources.console_sessions.get(session_id)
    if session is None:
        return None
    authenticator = resources.authenticator
    try:
        if session.kind is SessionKind.TENANT:
            assert session.tenant_id is not None  # SessionStore.open checks both
            assert session.api_key_id is not None
            tenant = await authenticator.tenant_key_in_force(session.tenant_id, session.api_key_id)
            return ConsoleCaller(session_id, session, tenant=tenant, admin=None)
        admin = await authenticator.admin_in_force(session.admin_key_id, session.admin_token_fingerprint)
        return ConsoleCaller(session_id, session, tenant=None, admin=admin)
    except ApiError:
        await resources.console_sessions.end(session_id)
        return None


async def _caller(connection: ASGIConnection[Any, Any, Any, Any]) -> ConsoleCaller:
    caller = await signed_in(connection)
    if caller is None:
        raise SignInRequired()
    if (
        connection.scope.get("method") in UNSAFE_METHODS
        and isinstance(connection, Request)
        and not tokens_match(caller.csrf_token, await presented_csrf_token(connection))
    ):
        raise ApiError(
            403,
            "This form is out of date or was not sent by this console (its CSRF token is missing or wrong). "
            "Reload the page and try again.",
            code="csrf_failed",
        )
    connection.state.console = caller
    return caller


async def require_console_session(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    await _caller(connection)


async def require_console_tenant(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    caller = await _caller(connection)
    if caller.tenant is None:
        raise ApiError(403, "This page is for tenants: sign in with one of your API keys.", code="forbidden")


async def require_console_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    caller = await _caller(connection)
    if caller.admin is None:
        raise ApiError(403, "This page is for admins.", code="forbidden")


async def provide_console_caller(request: ASGIConnection[Any, Any, Any, Any]) -> ConsoleCaller:
    caller: ConsoleCaller = request.state.console
    return caller


# What console handlers declare: `caller: Caller`.
Caller = NamedDependency[ConsoleCaller]
