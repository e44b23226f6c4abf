"""HTTP for a tenant's LoRA adapters under /v1/adapters."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.enums import RequestEncodingType
from litestar.exceptions import ClientException, ValidationException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import FromPath, FromQuery, MultipartBody
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import AppResources, DbSession, Principal
from loraplex.platform.domain.adapters.schemas import AdapterDeleted, AdapterOut, AdapterUploadFields
from loraplex.platform.domain.adapters.service import AdapterService
from loraplex.platform.domain.adapters.upload import ADAPTER_FILES, DRAFT_FILES, UploadedFile
from loraplex.platform.errors import ApiError, handle_exception, invalid_request, openai_error
from loraplex.platform.ids import TenantId
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import ObjectList, PageLimit
from loraplex.platform.settings import Settings

_UPLOAD_DESCRIPTION = """\
multipart/form-data with the text fields `name` (the adapter's name; uploading a name again adds a version) and
`base_model` (the name of the base model it was trained on), and the adapter as either two file parts,
`adapter_config.json` and `adapter_model.safetensors` (matched by field name or filename), or one file part holding
a .zip or .tar.gz with exactly those two files at its root. A draft counterpart (the LoRA the base model's draft
model runs for this adapter's requests, when the base model speculates with a draft model) comes beside them as
`draft/adapter_config.json` and `draft/adapter_model.safetensors`: two more file parts, or those members of the
archive; both or neither. Safetensors only: pickle and code are refused. The adapter is validated against the base
model, its counterpart against the draft model, before anything is stored; a bad upload answers 400 naming the file
or field at fault, and leaves nothing behind."""


def _require_multipart(request: Request[Any, Any, Any]) -> None:
    if request.content_type[0] != RequestEncodingType.MULTI_PART.value:
        raise ApiError(
            415,
            f"Upload an adapter as multipart/form-data (got {request.content_type[0] or 'no content type'}), with "
            f"the fields 'name' and 'base_model' and the files {' and '.join(ADAPTER_FILES)} or one .zip or "
            ".tar.gz of them.",
            code="unsupported_media_type",
        )


def _too_large(request: Request[Any, Any, Any], _: RequestEntityTooLarge) -> Response[dict[str, Any]]:
    limit = request.route_handler.resolve_request_max_body_size()
    return openai_error(
        413, f"The upload is larger than {limit} bytes, the most this server accepts.", code="upload_too_large"
    )


# Litestar's multipart parser answers a body over its part limits (count, header size) with a 400 whose whole
# message is "Request Entity Too Large", and a malformed one with "Invalid multipart/form-data" (the parser's
# reason is the exception's cause). Neither tells an uploader what to change.
_MULTIPART_LIMIT_DETAIL = "Request Entity Too Large"
_MULTIPART_INVALID_DETAIL = "Invalid multipart/form-data"


def _bad_multipart(request: Request[Any, Any, Any], exc: ClientException) -> Response[dict[str, Any]]:
    if isinstance(exc, ValidationException) or exc.detail not in (_MULTIPART_LIMIT_DETAIL, _MULTIPART_INVALID_DETAIL):
        return handle_exception(request, exc)
    if exc.detail == _MULTIPART_LIMIT_DETAIL:
        message = (
            f"The multipart body has more than {request.app.multipart_form_part_limit} parts, or a part whose headers "
            f"are longer than this server reads; send only the fields 'name' and 'base_model' and the files "
            f"{' and '.join(ADAPTER_FILES)} (or one .zip or .tar.gz of them)."
        )
    else:
        reason = f" ({exc.__cause__})" if exc.__cause__ is not None and str(exc.__cause__) else ""
        message = (
            f"The body is not valid multipart/form-data{reason}: check the boundary in the Content-Type header and "
            "that the body is complete."
        )
    return openai_error(400, message, code="invalid_multipart")


def _not_text(_: Request[Any, Any, Any], exc: UnicodeDecodeError) -> Response[dict[str, Any]]:
    # Litestar decodes a part without a filename as text; binary content sent that way fails there.
    return openai_error(
        400,
        f"A form field without a filename must be UTF-8 text ({exc.reason}); send {ADAPTER_FILES[1]} as a file "
        f"part with a filename (curl -F '{ADAPTER_FILES[1]}=@PATH').",
        code="invalid_adapter",
    )


class AdapterController(Controller):
    """Upload, list, get and delete adapters. Registered through `adapter_controller(settings)`."""

    path = "/adapters"
    tags = ["tenant: adapters"]

    @post(
        "/",
        status_code=201,
        summary="Upload a LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors)",
        description=_UPLOAD_DESCRIPTION,
        before_request=_require_multipart,
        exception_handlers={
            RequestEntityTooLarge: _too_large,
            UnicodeDecodeError: _not_text,
            ClientException: _bad_multipart,
        },
    )
    async def create(
        self, data: MultipartBody[dict[str, Any]], principal: Principal, db: DbSession, resources: AppResources
    ) -> AdapterOut:
        fields, parts = await read_adapter_form(data)
        return await create_adapter(db, resources, principal.tenant_id, fields, parts)

    @get("/", summary="List your adapters, newest first")
    async def list(
        self,
        principal: Principal,
        db: DbSession,
        resources: AppResources,
        limit: PageLimit = 20,
        after: FromQuery[uuid.UUID | None] = None,
        name: FromQuery[str | None] = None,
    ) -> ObjectList[AdapterOut]:
        service = AdapterService(db, resources)
        page = await service.list(principal.tenant_id, limit=limit, after=after, name=name)
        return ObjectList.of([await service.out(a) for a in page.items], has_more=page.has_more)

    @get("/{adapter_id:uuid}", summary="Get one of your adapters")
    async def get(
        self, adapter_id: FromPath[uuid.UUID], principal: Principal, db: DbSession, resources: AppResources
    ) -> AdapterOut:
        service = AdapterService(db, resources)
        return await service.out(await service.get(adapter_id, principal.tenant_id))

    @delete("/{adapter_id:uuid}", status_code=200, summary="Delete one of your adapters (unless an endpoint uses it)")
    async def delete(
        self, adapter_id: FromPath[uuid.UUID], principal: Principal, db: DbSession, resources: AppResources
    ) -> AdapterDeleted:
        await delete_adapter(db, resources, adapter_id, principal.tenant_id)
        return AdapterDeleted(id=adapter_id)


def adapter_controller(settings: Settings) -> type[AdapterController]:
    """AdapterController with this deployment's upload limit (settings.max_adapter_upload_bytes).

    Litestar fixes a route's body limit when the route is registered, so each app gets a subclass carrying it.
    A larger body is refused with 413 before it is read.
    """
    return type("AdapterController", (AdapterController,), {"request_max_body_size": settings.max_adapter_upload_bytes})


async def create_adapter(
    db: AsyncSession, resources: Resources, tenant_id: TenantId, fields: AdapterUploadFields, parts: list[UploadedFile]
) -> AdapterOut:
    """Validate, store and commit an upload (the API's and the console's way); a failed commit deletes the stored
    files again, so nothing is left half-written."""
    service = AdapterService(db, resources)
    adapter = await service.create(tenant_id, fields, parts)
    adapter_id = adapter.id
    try:
        await db.commit()
    except Exception:
        await service.delete_objects(tenant_id, adapter_id)
        raise
    return await service.out(adapter)


async def delete_adapter(db: AsyncSession, resources: Resources, adapter_id: uuid.UUID, tenant_id: TenantId) -> None:
    """Delete and commit one of the tenant's adapters (409 while an endpoint uses it), then its files."""
    service = AdapterService(db, resources)
    await service.delete(adapter_id, tenant_id)
    await db.commit()
    # After the commit: a failed commit must not leave a row whose files are gone.
    await service.delete_objects(tenant_id, adapter_id)


async def read_adapter_form(data: dict[str, Any]) -> tuple[AdapterUploadFields, list[UploadedFile]]:
    """The text fields and the file parts of the multipart body (a field sent twice arrives as a list)."""
    text: dict[str, str] = {}
    parts: list[UploadedFile] = []
    uploads = [v for values in data.values() for v in (values if isinstance(values, list) else [values])]
    try:
        for field, values in data.items():
            for value in values if isinstance(values, list) else [values]:
                if isinstance(value, UploadFile):
                    parts.append(UploadedFile(field=field, filename=value.filename or None, data=await value.read()))
                elif field in ADAPTER_FILES or field in DRAFT_FILES:
                    # A file sent as a plain field (curl -F 'adapter_config.json=<file'): its text is the content.
                    parts.append(UploadedFile(field=field, filename=None, data=str(value).encode()))
                elif field in text:
                    raise invalid_request(f"The field '{field}' is given twice.", param=field)
                else:
                    text[field] = str(value)
    finally:
        for upload in uploads:
            if isinstance(upload, UploadFile):
                await upload.close()
    try:
        return AdapterUploadFields.model_validate(text), parts
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "missing":
            message = f"Missing required field '{param}'."
        elif error["type"] == "extra_forbidden":
            message = f"Unknown field '{param}'."
        else:
            message = f"Invalid value for '{param}': {error['msg']}."
        raise invalid_request(message, param=param) from None
