"""Rendering console pages: the template engine, the frame every page shares (navigation, CSRF token, headers),
the formatting filters templates use, and the error pages.

Templates live in templates/console/ and extend `console/base.html`. The engine is the app's one Jinja engine: it
also finds the billing page's templates (billing/templates), with the billing page's settings (autoescape on,
undefined names fail), so the billing page renders the same bytes through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import ChoiceLoader, Environment, FileSystemLoader, StrictUndefined
from litestar import MediaType, Request, Response
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template

from loraplex.platform.console.access import ConsoleCaller, SignInRequired
from loraplex.platform.console.security import CSRF_HEADER, PAGE_HEADERS
from loraplex.platform.domain.billing.page import TEMPLATES as BILLING_TEMPLATES
from loraplex.platform.domain.billing.rating import MONEY_QUANTUM
from loraplex.platform.errors import handle_exception
from loraplex.platform.wording import plural

TEMPLATES = Path(__file__).with_name("templates")
STATIC = Path(__file__).with_name("static")
CONSOLE_PATH = "/console"
STATIC_PATH = "/console/static"


@dataclass(frozen=True, slots=True)
class NavItem:
    href: str
    label: str


TENANT_NAV = (
    NavItem("/console/playground", "Playground"),
    NavItem("/console/endpoints", "Endpoints"),
    NavItem("/console/adapters", "Adapters"),
    NavItem("/console/keys", "API keys"),
    NavItem("/console/usage", "Usage"),
)
ADMIN_NAV = (
    NavItem("/console/admin/tenants", "Tenants"),
    NavItem("/console/admin/models", "Models & prices"),
    NavItem("/console/admin/billing", "Billing"),
    NavItem("/console/admin/fleet", "Fleet"),
)


def home(caller: ConsoleCaller) -> str:
    """Where a signed-in browser lands."""
    return landing(admin=caller.is_admin, wanted=None)


def landing(*, admin: bool, wanted: str | None) -> str:
    """Where signing in leads: the page the browser was sent away from (`wanted`, a console path of this kind of
    session, never another site's), else the kind's first page."""
    if wanted and _is_local_console_path(wanted) and wanted.startswith("/console/admin") == admin:
        return wanted
    return (ADMIN_NAV if admin else TENANT_NAV)[0].href


def _is_local_console_path(path: str) -> bool:
    # A path on this host only: no scheme, no `//host`, no backslashes browsers read as slashes, no control text.
    return (
        path.startswith("/console/")
        and not path.startswith("//")
        and "\\" not in path
        and all(c.isprintable() and not c.isspace() for c in path)
        and len(path) <= 2048
    )


# --- filters ------------------------------------------------------------------------------------------------------


def usd(amount: Decimal | str | int) -> str:
    return f"${Decimal(amount).quantize(MONEY_QUANTUM):,f}"


def number(value: int | float) -> str:
    return f"{value:,}"


def size(num_bytes: int) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 600.2 KiB, 7.63 MiB."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    exponent = min(int(math.log(num_bytes, 1024)), 4)
    unit = ("B", "KiB", "MiB", "GiB", "TiB")[exponent]
    return f"{num_bytes / 1024**exponent:.{1 if exponent < 2 else 2}f} {unit}"


def when(value: datetime | str | None) -> str:
    """A time as `2026-12-02 14:05 UTC` (empty for None)."""
    if value is None:
        return ""
    instant = datetime.fromisoformat(value.replace("Z", "+00:00")) if isinstance(value, str) else value
    return f"{instant:%Y-%m-%d %H:%M} UTC"


FILTERS = {"plural": plural, "usd": usd, "number": number, "size": size, "when": when}


def template_engine() -> JinjaTemplateEngine:
    """The app's engine: console templates and the billing page's, with the billing page's settings."""
    environment = Environment(
        loader=ChoiceLoader([FileSystemLoader(TEMPLATES), FileSystemLoader(BILLING_TEMPLATES)]),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters.update(FILTERS)
    return JinjaTemplateEngine.from_environment(environment)


# --- responses ----------------------------------------------------------------------------------------------------


def page(
    template: str,
    caller: ConsoleCaller | None,
    *,
    title: str,
    status_code: int = 200,
    cookies: list[Any] | None = None,
    **context: Any,
) -> Template:
    """A console page: `template` (under templates/console/) in the shared frame, with the console's headers.
    `context` is the page's own; the frame adds the caller, the navigation and the CSRF token."""
    nav = () if caller is None else (ADMIN_NAV if caller.is_admin else TENANT_NAV)
    frame = {
        "caller": caller,
        "nav": nav,
        "title": title,
        "csrf_token": caller.csrf_token if caller is not None else context.pop("csrf_token", ""),
    }
    return Template(
        f"console/{template}",
        context={**frame, **context},
        media_type=MediaType.HTML,
        status_code=status_code,
        headers=PAGE_HEADERS,
        cookies=cookies or [],
    )


def wants_json(request: Request[Any, Any, Any]) -> bool:
    """A console script's request (it sends the CSRF header, or asks for JSON), answered in JSON, not a page."""
    accept = request.headers.get("accept", "")
    return CSRF_HEADER in request.headers or ("application/json" in accept and "text/html" not in accept)


def sign_in_required(request: Request[Any, Any, Any], _: SignInRequired) -> Response[Any]:
    if wants_json(request) or request.method != "GET":
        return Response(
            {"detail": "Your console session has ended: sign in again.", "code": "signed_out"},
            status_code=401,
            headers=PAGE_HEADERS,
        )
    wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    query = "" if not _is_local_console_path(wanted) else "?" + urlencode({"next": wanted})
    return Redirect(CONSOLE_PATH + query, status_code=303, headers=PAGE_HEADERS)


def console_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Errors on console paths: JSON for scripts, else a page saying what went wrong (never a raw JSON body)."""
    answer = handle_exception(request, exc)
    if wants_json(request):
        answer.headers.update(PAGE_HEADERS)
        return answer
    body = answer.content if isinstance(answer.content, dict) else {}
    caller = getattr(request.state, "console", None)
    template = page(
        "error.html",
        caller if isinstance(caller, ConsoleCaller) else None,
        title=str(body.get("title", "Error")),
        status_code=answer.status_code or 500,
        status=answer.status_code,
        message=str(body.get("detail", "Something went wrong.")),
    )
    for name, value in answer.headers.items():
        if name.lower() in ("retry-after", "www-authenticate"):
            template.headers[name] = value
    return template
