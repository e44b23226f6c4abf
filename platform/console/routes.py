"""The console's routers: sign-in (open), tenant pages, admin pages and the static files, all under /console.

Each router's guard admits only its kind of session (access.py); every response carries the console's headers, and
errors come back as pages (or JSON to the console's scripts), never as a raw API body.
"""

from __future__ import annotations

from typing import Any

from litestar import Response, Router
from litestar.di import Provide
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler, ExceptionHandlersMap, Guard

from loraplex.platform.console.access import (
    SignInRequired,
    provide_console_caller,
    require_console_admin,
    require_console_tenant,
)
from loraplex.platform.console.controllers.adapters import adapter_pages
from loraplex.platform.console.controllers.admin_billing import AdminBillingPages
from loraplex.platform.console.controllers.admin_fleet import AdminFleetPages
from loraplex.platform.console.controllers.admin_models import AdminModelPages
from loraplex.platform.console.controllers.admin_tenants import AdminTenantPages
from loraplex.platform.console.controllers.endpoints import EndpointPages
from loraplex.platform.console.controllers.keys import KeyPages
from loraplex.platform.console.controllers.playground import PlaygroundPages
from loraplex.platform.console.controllers.sign_in import SignInController
from loraplex.platform.console.controllers.usage import UsagePages
from loraplex.platform.console.pages import STATIC, STATIC_PATH, console_error, sign_in_required
from loraplex.platform.settings import Settings


async def _static_headers(response: Response[Any]) -> Response[Any]:
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-cache"  # revalidated, so a new release's script is never mixed with old
    return response


_HANDLERS: ExceptionHandlersMap = {SignInRequired: sign_in_required, Exception: console_error}
_CALLER = {"caller": Provide(provide_console_caller)}


def _router(path: str, handlers: list[ControllerRouterHandler], *, guards: list[Guard]) -> Router:
    return Router(
        path=path,
        route_handlers=handlers,
        guards=guards,
        exception_handlers=_HANDLERS,
        dependencies=_CALLER,
        include_in_schema=False,
    )


def console_routers(settings: Settings) -> list[ControllerRouterHandler]:
    tenant: list[ControllerRouterHandler] = [
        KeyPages,
        adapter_pages(settings),
        EndpointPages,
        UsagePages,
        PlaygroundPages,
    ]
    admin: list[ControllerRouterHandler] = [AdminTenantPages, AdminModelPages, AdminBillingPages, AdminFleetPages]
    return [
        _router("/", [SignInController], guards=[]),
        _router("/console", tenant, guards=[require_console_tenant]),
        _router("/console/admin", admin, guards=[require_console_admin]),
        create_static_files_router(
            path=STATIC_PATH,
            directories=[STATIC],
            name="console-static",
            include_in_schema=False,
            exception_handlers=_HANDLERS,
            after_request=_static_headers,
        ),
    ]
