"""The tenant's Endpoints page: the list (with how to call each one), create on a base model or one of the tenant's
ready adapters, and delete."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.forms import Form, FormData, parse_form
from loraplex.platform.console.pages import page
from loraplex.platform.console.security import PAGE_HEADERS
from loraplex.platform.db.pagination import MAX_PAGE_SIZE
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.adapters.models import AdapterStatus
from loraplex.platform.domain.adapters.schemas import AdapterOut
from loraplex.platform.domain.adapters.service import AdapterService
from loraplex.platform.domain.base_models.service import BaseModelService
from loraplex.platform.domain.endpoints.schemas import EndpointCreate, EndpointName, EndpointOut
from loraplex.platform.domain.endpoints.service import EndpointService
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import Name

TITLE = "Endpoints"
PATH = "/console/endpoints"


class EndpointForm(Form):
    name: EndpointName
    base_model: Name
    adapter_id: uuid.UUID | None = None  # the select's "none (the base model)" is blank, so None


_LABELS = {"name": "the endpoint's name", "base_model": "the base model", "adapter_id": "the adapter"}


@dataclass(frozen=True, slots=True)
class EndpointRow:
    """An endpoint as the list shows it: with its adapter's name and version (None: the base model alone)."""

    endpoint: EndpointOut
    adapter: AdapterOut | None


async def _page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    request: Request[Any, Any, Any],
    *,
    created: EndpointOut | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Template:
    tenant_id = caller.principal.tenant_id
    endpoints = EndpointService(db)
    adapters = AdapterService(db, resources)
    listed = await endpoints.list(tenant_id, limit=MAX_PAGE_SIZE, after=None)
    recent = await adapters.list(tenant_id, limit=MAX_PAGE_SIZE, after=None)
    known = {adapter.id: adapter for adapter in recent.items}
    rows = []
    for row in listed.items:
        out = await endpoints.out(row)
        adapter = None
        if out.adapter_id is not None:
            # An endpoint may use an adapter older than the newest page; the FK guarantees it exists.
            adapter = known.get(out.adapter_id) or await adapters.get(out.adapter_id, tenant_id)
        rows.append(EndpointRow(out, await adapters.out(adapter) if adapter is not None else None))
    ready = [await adapters.out(a) for a in recent.items if a.status == AdapterStatus.READY.value]
    base_models = [model.name for model in await BaseModelService(db, resources.model_configs).list()]
    return page(
        "endpoints.html",
        caller,
        title=TITLE,
        status_code=status_code,
        endpoints=rows,
        more=listed.has_more,
        base_models=base_models,
        # The ready adapters by base model, for the select's option groups.
        ready_adapters={name: [a for a in ready if a.base_model == name] for name in base_models},
        api_base=_api_base(resources, request),
        created=created,
        error=error,
    )


def _api_base(resources: Resources, request: Request[Any, Any, Any]) -> str:
    """The OpenAI base URL clients use: the platform's public URL where one is set, else the address this page was
    reached at."""
    base = resources.settings.public_url or str(request.base_url)
    return base.rstrip("/") + "/v1"


class EndpointPages(Controller):
    path = "/endpoints"

    @get("/")
    async def index(
        self, request: Request[Any, Any, Any], caller: Caller, db: DbSession, resources: AppResources
    ) -> Template:
        return await _page(caller, db, resources, request)

    @post("/", status_code=200)
    async def create(
        self, request: Request[Any, Any, Any], caller: Caller, db: DbSession, resources: AppResources, data: FormData
    ) -> Template:
        service = EndpointService(db)
        try:
            form = parse_form(EndpointForm, data, labels=_LABELS)
            endpoint, _ = await service.create(
                caller.principal.tenant_id,
                EndpointCreate(name=form.name, base_model=form.base_model, adapter_id=form.adapter_id),
            )
            await db.commit()
        except ApiError as exc:
            return await _page(caller, db, resources, request, error=exc.message, status_code=exc.status_code)
        return await _page(caller, db, resources, request, created=await service.out(endpoint), status_code=201)

    @post("/{endpoint_id:uuid}/delete", status_code=303)
    async def delete(self, endpoint_id: FromPath[uuid.UUID], caller: Caller, db: DbSession) -> Response[Any]:
        # Another tenant's endpoint answers 404, as on the API (the service scopes by tenant).
        await EndpointService(db).delete(endpoint_id, caller.principal.tenant_id)
        await db.commit()
        return Redirect(PATH, status_code=303, headers=PAGE_HEADERS)
