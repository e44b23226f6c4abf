"""The console's browser-facing protections: its response headers, its cookies, CSRF tokens and the sign-in throttle.

- Content-Security-Policy: the billing page's (nothing loads from anywhere else, no frames, no inline script), with
  what a console needs from its own origin only: its stylesheet and script files, `fetch` to itself, forms posting
  to itself. No inline script or style is allowed, so markup a tenant controls cannot run or restyle anything.
- The session cookie is HttpOnly and SameSite=Strict, Secure (and `__Host-` prefixed) when the public URL is https.
- CSRF: every unsafe request of a signed-in browser carries the session's token, in the form field `csrf_token` or
  the `X-CSRF-Token` header (the scripts' fetches). Sign-in, before any session exists, uses a double-submit token:
  the form's hidden field must equal a SameSite=Strict cookie set with the form.
- Sign-in attempts are counted per client address in a fixed one-minute window in the shared store.
"""

from __future__ import annotations

import hmac
import math
import time
from typing import Any

from litestar import Request
from litestar.datastructures import Cookie

from loraplex.platform.kv import KeyValueStore
from loraplex.platform.settings import Settings

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",  # pages show keys once, names and money: never for a shared cache or the back button
}
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SIGN_IN_CSRF_COOKIE = "lpx_console_signin"
SIGN_IN_WINDOW_S = 60.0
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def secure_cookies(settings: Settings) -> bool:
    """Cookies are Secure when browsers reach this platform over https (its public URL says so)."""
    return (settings.public_url or "").lower().startswith("https://")


def session_cookie_name(settings: Settings) -> str:
    # `__Host-` makes a browser refuse the cookie unless it is Secure, host-only and for path /: no subdomain or
    # plain-http page can plant or overwrite it.
    return "__Host-lpx_console" if secure_cookies(settings) else "lpx_console"


def session_cookie(settings: Settings, value: str, *, max_age: int) -> Cookie:
    return Cookie(
        key=session_cookie_name(settings),
        value=value,
        path="/",
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=secure_cookies(settings),
    )


def expired_session_cookie(settings: Settings) -> Cookie:
    return session_cookie(settings, "", max_age=0)


def sign_in_cookie(settings: Settings, token: str) -> Cookie:
    return Cookie(
        key=SIGN_IN_CSRF_COOKIE,
        value=token,
        path="/console",
        max_age=3600,
        httponly=True,
        samesite="strict",
        secure=secure_cookies(settings),
    )


def tokens_match(expected: str | None, presented: str | None) -> bool:
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


async def presented_csrf_token(request: Request[Any, Any, Any]) -> str | None:
    """The CSRF token an unsafe request carries: the header (fetch), else the form field. Reading the form here
    parses the body once; Litestar keeps the parsed form for the handler."""
    header = request.headers.get(CSRF_HEADER)
    if header:
        return header
    content_type = request.content_type[0]
    if content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return None
    form = await request.form()
    value = form.get(CSRF_FIELD)
    return value if isinstance(value, str) else None


def client_address(request: Request[Any, Any, Any]) -> str:
    """The address sign-in attempts are counted under: the peer's. Behind a proxy that is the proxy's, unless the
    server runs with uvicorn's --proxy-headers (it then reads X-Forwarded-For from trusted proxies)."""
    return request.client.host if request.client is not None else "unknown"


class SignInThrottle:
    """At most `attempts_per_minute` sign-in attempts per client address and window, across replicas."""

    def __init__(self, kv: KeyValueStore, *, attempts_per_minute: int) -> None:
        self._kv = kv
        self._limit = attempts_per_minute

    async def admit(self, address: str) -> float | None:
        """Count one attempt; None if it may go ahead, else the seconds until the window ends."""
        now = time.time()
        window = math.floor(now / SIGN_IN_WINDOW_S)
        count = await self._kv.incr(f"console:sign-in:{address}:{window}", ttl_s=SIGN_IN_WINDOW_S)
        if count <= self._limit:
            return None
        return max(1.0, (window + 1) * SIGN_IN_WINDOW_S - now)
