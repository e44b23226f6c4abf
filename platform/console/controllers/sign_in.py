"""Signing in and out of the console: GET /console (the form, or the home page when signed in), POST
/console/sign-in, POST /console/sign-out.

A key is only ever sent in a POST body: never in a URL, never echoed back into a page, never logged. A refused
key gets one message whatever the reason (unknown, revoked, suspended tenant), so the form cannot be used to learn
which keys exist.
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.datastructures import Cookie
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromQuery
from litestar.response import Redirect, Template
from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.auth import AdminPrincipal, TenantPrincipal
from loraplex.platform.console.access import Caller, require_console_session, signed_in
from loraplex.platform.console.pages import CONSOLE_PATH, landing, page
from loraplex.platform.console.security import (
    PAGE_HEADERS,
    SIGN_IN_CSRF_COOKIE,
    client_address,
    expired_session_cookie,
    session_cookie,
    session_cookie_name,
    sign_in_cookie,
    tokens_match,
)
from loraplex.platform.console.sessions import SessionKind, new_token
from loraplex.platform.dependencies import AppResources
from loraplex.platform.domain.api_keys.keys import KeyKind, parse_key
from loraplex.platform.errors import ApiError
from loraplex.platform.ids import AdminKeyId
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

REFUSED = "That key was not accepted. Use one of your tenant's API keys (lpx_...), an admin key or the admin token."
MAX_KEY_CHARS = 256


class SignInForm(BaseModel):
    model_config = ConfigDict(extra="ignore")

    key: str = Field(default="", max_length=MAX_KEY_CHARS)
    csrf_token: str = Field(default="", max_length=128)
    next: str = Field(default="", max_length=2048)  # the page the browser was sent to sign in from


def _form(resources: Resources, *, wanted: str, status_code: int = 200, error: str | None = None) -> Template:
    """The sign-in page with a fresh double-submit token in its form and its cookie."""
    token = new_token()
    return page(
        "sign_in.html",
        None,
        title="Sign in",
        status_code=status_code,
        cookies=[sign_in_cookie(resources.settings, token)],
        csrf_token=token,
        error=error,
        wanted=wanted,
    )


async def _authenticate(resources: Resources, key: str) -> TenantPrincipal | AdminPrincipal | None:
    """The principal `key` signs in as, or None. Tenant keys by their shape; anything else is tried as admin."""
    authorization = f"Bearer {key}"
    parsed = parse_key(key)
    try:
        if parsed is not None and parsed.kind is KeyKind.TENANT:
            return await resources.authenticator.tenant(authorization)
        return await resources.authenticator.admin(authorization)
    except ApiError:
        return None


class SignInController(Controller):
    path = CONSOLE_PATH
    include_in_schema = False

    @get("/", summary="The console: its sign-in form, or your home page when signed in")
    async def index(
        self, request: Request[Any, Any, Any], resources: AppResources, next: FromQuery[str] = ""
    ) -> Template | Redirect:
        caller = await signed_in(request)
        if caller is not None:
            return Redirect(landing(admin=caller.is_admin, wanted=next), status_code=303, headers=PAGE_HEADERS)
        return _form(resources, wanted=next[:2048])

    @post("/sign-in", status_code=303)
    async def sign_in(
        self,
        request: Request[Any, Any, Any],
        resources: AppResources,
        data: Annotated[SignInForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
    ) -> Template | Redirect:
        settings = resources.settings
        wait_s = await resources.sign_in_throttle.admit(client_address(request))
        if wait_s is not None:
            template = _form(
                resources,
                wanted=data.next,
                status_code=429,
                error=f"Too many sign-in attempts from your address; try again in {int(wait_s)} s.",
            )
            template.headers["Retry-After"] = str(int(wait_s))
            return template
        if not tokens_match(request.cookies.get(SIGN_IN_CSRF_COOKIE), data.csrf_token):
            return _form(resources, wanted=data.next, status_code=403, error="The sign-in form expired; try again.")
        principal = await _authenticate(resources, data.key.strip())
        if principal is None:
            return _form(resources, wanted=data.next, status_code=401, error=REFUSED)
        old = request.cookies.get(session_cookie_name(settings))
        if old:
            await resources.console_sessions.end(old)
        if isinstance(principal, TenantPrincipal):
            session_id, _ = await resources.console_sessions.open(
                SessionKind.TENANT, tenant_id=principal.tenant_id, api_key_id=principal.key_id
            )
        elif principal.key_id is None:
            session_id, _ = await resources.console_sessions.open(
                SessionKind.ADMIN, admin_token_fingerprint=resources.authenticator.admin_token_fingerprint()
            )
        else:
            session_id, _ = await resources.console_sessions.open(
                SessionKind.ADMIN, admin_key_id=AdminKeyId(principal.key_id)
            )
        return Redirect(
            landing(admin=isinstance(principal, AdminPrincipal), wanted=data.next),
            status_code=303,
            headers=PAGE_HEADERS,
            cookies=[
                session_cookie(settings, session_id, max_age=int(resources.console_sessions.ttl_s)),
                _spent_sign_in_cookie(settings),
            ],
        )

    @post("/sign-out", status_code=303, guards=[require_console_session])
    async def sign_out(self, caller: Caller, resources: AppResources) -> Redirect:
        await resources.console_sessions.end(caller.session_id)
        return Redirect(
            CONSOLE_PATH,
            status_code=303,
            headers=PAGE_HEADERS,
            cookies=[expired_session_cookie(resources.settings)],
        )


def _spent_sign_in_cookie(settings: Settings) -> Cookie:
    """The sign-in form's token, used up: a new form gets a new one."""
    cookie = sign_in_cookie(settings, "")
    cookie.max_age = 0
    return cookie
