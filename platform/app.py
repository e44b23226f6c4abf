"""The Litestar application factory. `create_app(settings)` is the only way a platform app is built."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from litestar import Litestar, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.plugins.pydantic import PydanticPlugin
from litestar.template.config import TemplateConfig

from loraplex.engine.serve import GuardedRequest, refuse_nul_bytes
from loraplex.platform.console.pages import template_engine
from loraplex.platform.console.routes import console_routers
from loraplex.platform.dependencies import (
    OpenInConsole,
    open_in_console,
    provide_admin,
    provide_db,
    provide_principal,
    provide_resources,
    require_admin,
    require_tenant,
)
from loraplex.platform.domain.adapters.controllers import adapter_controller
from loraplex.platform.domain.api_keys.controllers import AdminApiKeyController, TenantApiKeyController
from loraplex.platform.domain.base_models.controllers import AdminBaseModelController
from loraplex.platform.domain.billing.controllers import AdminBillingController, AdminPriceController
from loraplex.platform.domain.completions.controllers import CompletionsController
from loraplex.platform.domain.embeddings.controllers import EmbeddingsController
from loraplex.platform.domain.endpoints.controllers import EndpointController
from loraplex.platform.domain.fleet.controllers import AdminEngineController
from loraplex.platform.domain.messages.controllers import MessagesController
from loraplex.platform.domain.responses.background import BackgroundResponses
from loraplex.platform.domain.responses.controllers import ResponsesController
from loraplex.platform.domain.tenants.controllers import AdminTenantController, TenantSelfController
from loraplex.platform.domain.usage.controllers import UsageController
from loraplex.platform.errors import handle_exception
from loraplex.platform.health import HealthController
from loraplex.platform.jobs.worker import JobWorker
from loraplex.platform.metrics import MetricsController
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings


def _version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(settings: Settings, *, check_migrations: bool = True) -> Litestar:
    """Build the app. Connections open in the lifespan, so building is cheap and never touches the network."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncGenerator[None, None]:
        resources = await Resources.open(settings, check_migrations=check_migrations)
        app.state.resources = resources
        stop_draining = asyncio.Event()
        drainer = asyncio.create_task(resources.usage.run_drainer(settings.usage_drain_interval_s, stop_draining))
        if settings.jobs_concurrency > 0:
            resources.jobs = JobWorker(
                resources.sessions,
                [BackgroundResponses(resources)],
                lease_s=settings.jobs_lease_s,
                poll_s=settings.jobs_poll_interval_s,
                concurrency=settings.jobs_concurrency,
            )
            resources.jobs.start()
        try:
            yield
        finally:
            if resources.jobs is not None:  # its jobs go back to the queue (before usage closes: they may bill)
                await resources.jobs.close()
            stop_draining.set()  # let a round in progress finish its database call (see run_drainer)
            try:
                await asyncio.wait_for(asyncio.shield(drainer), timeout=15)
            except TimeoutError:
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
            await resources.usage.close()
            await resources.close()

    v1 = Router(
        path="/v1",
        route_handlers=[
            TenantSelfController,
            TenantApiKeyController,
            EndpointController,
            UsageController,
            adapter_controller(settings),
            CompletionsController,
            EmbeddingsController,
            MessagesController,
            ResponsesController,
        ],
        guards=[require_tenant],
        dependencies={"principal": Provide(provide_principal)},
        security=[{"ApiKey": []}],
    )
    admin = Router(
        path="/admin",
        route_handlers=[
            AdminTenantController,
            AdminApiKeyController,
            AdminBaseModelController,
            AdminEngineController,
            AdminPriceController,
            AdminBillingController,
        ],
        guards=[require_admin],
        exception_handlers={OpenInConsole: open_in_console},
        dependencies={"admin": Provide(provide_admin)},
        security=[{"AdminToken": []}],
    )
    # Per-tenant series are the deployment's business, not the internet's: scrapes carry the admin credential
    # (Prometheus' `authorization` with an admin key; decision 0018).
    operations = Router(
        path="/",
        route_handlers=[MetricsController],
        guards=[require_admin],
        security=[{"AdminToken": []}],
    )
    return Litestar(
        route_handlers=[HealthController, operations, v1, admin, *console_routers(settings)],
        lifespan=[lifespan],
        dependencies={"db": Provide(provide_db), "resources": Provide(provide_resources)},
        exception_handlers={Exception: handle_exception},
        request_class=GuardedRequest,
        before_request=refuse_nul_bytes,
        # Bodies are validated strictly, as OpenAI validates them (schemas.RequestBody).
        plugins=[PydanticPlugin(validate_strict=True)],
        # The console's and the billing page's templates; billing.page.render renders the billing page through an
        # engine with the same settings.
        template_config=TemplateConfig(instance=template_engine()),
        openapi_config=OpenAPIConfig(
            title="loraplex",
            version=_version(),
            path="/schema",
            components=Components(
                security_schemes={
                    "ApiKey": SecurityScheme(type="http", scheme="bearer", description="A tenant key, lpx_..."),
                    "AdminToken": SecurityScheme(
                        type="http",
                        scheme="bearer",
                        description="The admin token or an admin key, lpxadm_...",
                    ),
                }
            ),
        ),
    )
