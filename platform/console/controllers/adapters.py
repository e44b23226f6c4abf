"""The tenant's Adapters page: the list (status, rank, size, digest, draft counterpart), an upload form and delete.

The upload goes through the API's own parsing and service (`read_adapter_form`, `create_adapter`), so a file is
refused for the same reasons, with the same message naming it, and nothing is left half-written. Without
JavaScript the form posts normally and the answer is the page again, with the result or the error. static/upload.js
sends the same form with XMLHttpRequest (for a progress bar) and asks for JSON: the new adapter, or problem JSON.
"""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.datastructures import UploadFile
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import FromPath, MultipartBody
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.pages import console_error, page, wants_json
from loraplex.platform.console.security import CSRF_FIELD, PAGE_HEADERS
from loraplex.platform.db.pagination import MAX_PAGE_SIZE
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.adapters.controllers import create_adapter, delete_adapter, read_adapter_form
from loraplex.platform.domain.adapters.schemas import AdapterOut
from loraplex.platform.domain.adapters.service import AdapterService
from loraplex.platform.domain.adapters.upload import ADAPTER_FILES
from loraplex.platform.domain.base_models.service import BaseModelService
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

TITLE = "Adapters"
PATH = "/console/adapters"
ARCHIVE_INPUT = "archive"  # any name but the two files' is read as an archive (upload.read_upload)
FILE_INPUTS = (*ADAPTER_FILES, ARCHIVE_INPUT)


async def _page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    *,
    uploaded: AdapterOut | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Template:
    service = AdapterService(db, resources)
    listed = await service.list(caller.principal.tenant_id, limit=MAX_PAGE_SIZE, after=None)
    base_models = await BaseModelService(db, resources.model_configs).list()
    return page(
        "adapters.html",
        caller,
        title=TITLE,
        status_code=status_code,
        adapters=[await service.out(adapter) for adapter in listed.items],
        more=listed.has_more,
        base_models=[model.name for model in base_models],
        uploaded=uploaded,
        error=error,
    )


async def _upload_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The form as the API's upload parser reads it: without the CSRF field (the guard has checked it) and without
    the file inputs left empty. A browser sends one of those as a part with an empty filename and no bytes, which
    Litestar hands over as the text "" (a part without a filename is a text field), or as an UploadFile without a
    filename."""
    fields: dict[str, Any] = {}
    for name, values in data.items():
        if name == CSRF_FIELD:
            continue
        kept = []
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, UploadFile) and not value.filename:
                await value.close()
            elif not (name in FILE_INPUTS and value == ""):
                kept.append(value)
        if kept:
            fields[name] = kept if len(kept) > 1 else kept[0]
    return fields


def _too_large(request: Request[Any, Any, Any], _: RequestEntityTooLarge) -> Response[Any]:
    limit = request.route_handler.resolve_request_max_body_size()
    error = ApiError(
        413, f"The upload is larger than {limit:,} bytes, the most this server accepts.", code="upload_too_large"
    )
    return console_error(request, error)


class AdapterPages(Controller):
    """Registered through `adapter_pages(settings)`, which sets the upload route's body limit."""

    path = "/adapters"

    @get("/")
    async def index(self, caller: Caller, db: DbSession, resources: AppResources) -> Template:
        return await _page(caller, db, resources)

    @post("/", status_code=201, exception_handlers={RequestEntityTooLarge: _too_large})
    async def upload(
        self,
        request: Request[Any, Any, Any],
        data: MultipartBody[dict[str, Any]],
        caller: Caller,
        db: DbSession,
        resources: AppResources,
    ) -> Response[Any]:
        script = wants_json(request)
        try:
            fields, parts = await read_adapter_form(await _upload_fields(data))
            created = await create_adapter(db, resources, caller.principal.tenant_id, fields, parts)
        except ApiError as exc:
            if script:
                raise  # console_error answers the script with problem JSON whose `detail` is the message
            return await _page(caller, db, resources, error=exc.message, status_code=exc.status_code)
        if script:
            return Response(created, status_code=201, media_type=MediaType.JSON, headers=PAGE_HEADERS)
        return await _page(caller, db, resources, uploaded=created, status_code=201)

    @post("/{adapter_id:uuid}/delete", status_code=303)
    async def delete(
        self, adapter_id: FromPath[uuid.UUID], caller: Caller, db: DbSession, resources: AppResources
    ) -> Response[Any]:
        try:
            await delete_adapter(db, resources, adapter_id, caller.principal.tenant_id)
        except ApiError as exc:
            # 409 while an endpoint uses it; 404 for an id that is not this tenant's (the service scopes by tenant).
            return await _page(caller, db, resources, error=exc.message, status_code=exc.status_code)
        return Redirect(PATH, status_code=303, headers=PAGE_HEADERS)


def adapter_pages(settings: Settings) -> type[AdapterPages]:
    """AdapterPages with this deployment's upload limit (as `adapter_controller` does for the API): Litestar fixes a
    route's body limit when the route is registered, so each app gets a subclass carrying it."""
    return type("AdapterPages", (AdapterPages,), {"request_max_body_size": settings.max_adapter_upload_bytes})
