"""Adapter logic: an upload is read (upload.py), validated by the engine's own parse_adapter against its base
model, stored in the object store, and recorded as the next version of its name. Stateless; never commits.

Nothing half-written: validation happens before anything is stored; `create` deletes the objects it stored if it
fails after storing them; a caller whose commit fails afterwards calls `delete_objects`. Objects live under
`tenants/{tenant_id}/adapters/{adapter_id}/` (adapter_config.json, adapter_model.safetensors, and a draft
counterpart's two files under draft/, where the engine looks for them): keyed by the adapter's id, not its name and
version, so nothing is ever overwritten.

A draft counterpart is validated like the adapter, against the base model's draft model (its speculative_config
must be a draft_model one): an engine would otherwise find out only when loading it, and fall back to the bare
draft without telling anyone.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.to_thread
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.engine import CheckpointError, ModelConfig, SpeculativeConfig
from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE, AdapterError, LoraAdapter, parse_adapter
from loraplex.platform.db.pagination import Page
from loraplex.platform.domain.adapters.models import Adapter, AdapterStatus
from loraplex.platform.domain.adapters.repository import AdapterRepository
from loraplex.platform.domain.adapters.schemas import AdapterOut, AdapterUploadFields
from loraplex.platform.domain.adapters.upload import (
    DRAFT_CONFIG_FILE,
    DRAFT_FILES,
    DRAFT_WEIGHTS_FILE,
    AdapterFiles,
    UploadedFile,
    UploadFiles,
    UploadLimits,
    UploadTooLarge,
    read_upload,
)
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.endpoints.repository import EndpointRepository
from loraplex.platform.errors import ApiError, conflict, invalid_request, not_found
from loraplex.platform.ids import TenantId
from loraplex.platform.objectstore import LocalObjectStore, ObjectStoreError, S3ObjectStore
from loraplex.platform.resources import Resources

logger = logging.getLogger(__name__)

# Concurrent uploads under one name race for the next version; the unique constraint picks a winner and the
# others try the version after it.
_MAX_VERSION_ATTEMPTS = 5
_CONTENT_TYPES = {CONFIG_FILE: "application/json", WEIGHTS_FILE: "application/octet-stream"}
# parse_adapter names the file at fault by its own name; a draft counterpart's error names the draft/ file.
_DRAFT_FIELDS = {CONFIG_FILE: DRAFT_CONFIG_FILE, WEIGHTS_FILE: DRAFT_WEIGHTS_FILE}


class AdapterLocation(NamedTuple):
    """Where an engine loads a ready adapter from, and its content digest (what an engine AdapterRef carries)."""

    uri: str  # s3://{bucket}/tenants/{tenant_id}/adapters/{adapter_id}, or that folder's absolute local path
    digest: str  # "sha256:<hex>" over both files (engine.lora.adapter_digest)


@dataclass(frozen=True, slots=True)
class _Validated:
    """An upload that passed every check: its files, the adapter parsed against the base model, and the draft
    counterpart parsed against the base model's draft model (None when the upload has none)."""

    files: UploadFiles
    adapter: LoraAdapter
    draft: LoraAdapter | None


def adapter_prefix(tenant_id: uuid.UUID, adapter_id: uuid.UUID) -> str:
    """The object key prefix (ending in "/") of one adapter's files."""
    return f"tenants/{tenant_id}/adapters/{adapter_id}/"


def require_ready(adapter: Adapter, *, param: str | None = None) -> None:
    """The one rule for an adapter that cannot serve yet (validating, or failed): 409 adapter_not_ready, a conflict
    with the adapter's state, wherever it is named (an endpoint made on it, a completion through one)."""
    if adapter.status != AdapterStatus.READY.value or adapter.digest is None:
        raise ApiError(
            409,
            f"Adapter '{adapter.name}' v{adapter.version} is not ready (status {adapter.status}).",
            code="adapter_not_ready",
            param=param,
        )


def ready_adapter_ref(resources: Resources, adapter: Adapter) -> AdapterLocation:
    """Where an engine loads `adapter` from (its folder, holding adapter_config.json and
    adapter_model.safetensors as `loraplex.engine.lora.read_adapter_dir` reads them) and its content digest.

    With the S3 object store the folder is `s3://{bucket}/tenants/{tenant_id}/adapters/{adapter_id}`; with the
    local one (embedded mode) it is that folder's absolute path on this machine. No I/O. Raises `require_ready`'s
    409 unless the adapter is ready. Also `AdapterService.ready_adapter_ref(adapter)`.
    """
    require_ready(adapter)
    assert adapter.digest is not None
    folder = adapter_prefix(adapter.tenant_id, adapter.id).rstrip("/")
    objects = resources.objects
    if isinstance(objects, S3ObjectStore):
        return AdapterLocation(f"s3://{objects.config.bucket}/{folder}", adapter.digest)
    if isinstance(objects, LocalObjectStore):
        return AdapterLocation(str(Path(objects.root, folder).resolve()), adapter.digest)
    raise TypeError(f"no adapter location for an object store of type {type(objects).__name__}")


class AdapterService:
    def __init__(self, session: AsyncSession, resources: Resources) -> None:
        self._session = session
        self._adapters = AdapterRepository(session)
        self._endpoints = EndpointRepository(session)
        self._base_models = BaseModelRepository(session)
        self._resources = resources

    async def create(self, tenant_id: TenantId, fields: AdapterUploadFields, parts: Sequence[UploadedFile]) -> Adapter:
        """Validate an upload, store its files and add its row (flushed, not committed); the new version's row.

        Every AdapterError (from reading the upload or from parse_adapter) becomes a 400 whose message is the
        error's and whose param is its field; an archive that unpacks past the limits is a 413. On any failure
        after the files were stored, they are deleted again.
        """
        base = await self._base_models.get_by_name(fields.base_model)
        if base is None:
            raise invalid_request(f"No base model named '{fields.base_model}'.", param="base_model")
        validated = await self._validate(parts, base)
        files, parsed = validated.files.adapter, validated.adapter

        adapter_id = uuid.uuid4()
        prefix = adapter_prefix(tenant_id, adapter_id)
        named = [(prefix + name, data) for name, data in validated.files.named()]
        await self._store(named)
        keys = [key for key, _ in named]
        try:
            adapter = await self._add_next_version(
                Adapter(
                    id=adapter_id,
                    tenant_id=tenant_id,
                    name=fields.name,
                    base_model_id=base.id,
                    status=AdapterStatus.READY.value,
                    digest=parsed.digest,
                    draft_digest=validated.draft.digest if validated.draft is not None else None,
                    rank=parsed.max_rank,
                    size_bytes=len(files.weights),
                )
            )
        except BaseException:
            await self._delete_keys(keys)
            raise
        logger.info(
            "adapter %s (%s v%d, rank %d, %d bytes) stored for tenant %s",
            adapter.id,
            adapter.name,
            adapter.version,
            parsed.max_rank,
            len(files.weights),
            tenant_id,
        )
        return adapter

    async def get(self, adapter_id: uuid.UUID, tenant_id: TenantId) -> Adapter:
        adapter = await self._adapters.get_readable_by_id(adapter_id, tenant_id)
        if adapter is None:
            raise not_found("adapter", adapter_id)
        return adapter

    async def list(
        self, tenant_id: TenantId, *, limit: int, after: uuid.UUID | None, name: str | None = None
    ) -> Page[Adapter]:
        return await self._adapters.list_for_tenant(tenant_id, limit=limit, after=after, name=name)

    async def list_by_digests(self, digests: Collection[str]) -> Sequence[tuple[Adapter, str]]:
        """Any tenant's adapters with these content digests, each with its tenant's name (admin only: what the
        engines' resident digests are)."""
        return await self._adapters.list_by_digests(digests)

    async def delete(self, adapter_id: uuid.UUID, tenant_id: TenantId) -> Adapter:
        """Remove the row (flushed, not committed), refusing while an endpoint uses the adapter.

        The objects stay until the caller has committed and calls `delete_objects`: deleting them first would
        leave a row without files if the commit failed.
        """
        adapter = await self.get(adapter_id, tenant_id)
        in_use = f"Adapter '{adapter.name}' v{adapter.version} is used by an endpoint; delete the endpoint first."
        if await self._endpoints.count_using_adapter(adapter.id, tenant_id) > 0:
            raise conflict(in_use)
        try:
            async with self._session.begin_nested():
                await self._adapters.delete(adapter)
        except IntegrityError:  # an endpoint took it between the count and the delete (the FK is RESTRICT)
            raise conflict(in_use) from None
        return adapter

    async def delete_objects(self, tenant_id: uuid.UUID, adapter_id: uuid.UUID) -> None:
        """Delete every object under the adapter's prefix; failures are logged (they leave garbage, not errors).

        Takes ids, not the row: callers run it after a commit (or a failed one), when the row may be gone.
        """
        prefix = adapter_prefix(tenant_id, adapter_id)
        try:
            keys = await self._resources.objects.list(prefix)
        except ObjectStoreError:
            logger.exception("could not list %s to delete it; its objects are left behind", prefix)
            return
        await self._delete_keys(keys)

    def ready_adapter_ref(self, adapter: Adapter) -> AdapterLocation:
        """Where an engine loads `adapter` from, and its digest: see the module function `ready_adapter_ref`."""
        return ready_adapter_ref(self._resources, adapter)

    async def out(self, adapter: Adapter) -> AdapterOut:
        base = await self._base_models.get(adapter.base_model_id)
        return AdapterOut.of(adapter, base.name if base else "")

    async def _validate(self, parts: Sequence[UploadedFile], base: BaseModel) -> _Validated:
        try:
            files = await anyio.to_thread.run_sync(read_upload, parts, self._upload_limits())
            model_config = await self._resources.model_configs.of(base.source)
            parsed = await self._parse(files.adapter, model_config)
        except UploadTooLarge as exc:
            raise ApiError(413, str(exc), code="upload_too_large", param=exc.field) from None
        except AdapterError as exc:
            raise invalid_request(str(exc), param=exc.field, code="invalid_adapter") from None
        if files.draft is None:
            return _Validated(files, parsed, None)
        draft_config = await self._draft_model_config(base)
        try:
            draft = await self._parse(files.draft, draft_config)
        except AdapterError as exc:
            raise invalid_request(
                f"The draft counterpart ({', '.join(DRAFT_FILES)}) does not fit the base model's draft model: {exc}",
                param=_DRAFT_FIELDS.get(exc.field, exc.field) if exc.field is not None else DRAFT_CONFIG_FILE,
                code="invalid_adapter",
            ) from None
        return _Validated(files, parsed, draft)

    def _upload_limits(self) -> UploadLimits:
        settings = self._resources.settings
        return UploadLimits(
            max_weights_bytes=settings.max_adapter_upload_bytes, max_total_bytes=settings.max_adapter_upload_bytes
        )

    async def _parse(self, files: AdapterFiles, model_config: ModelConfig) -> LoraAdapter:
        """parse_adapter on a worker thread, under this server's rank and size limits."""
        settings = self._resources.settings
        return await anyio.to_thread.run_sync(
            partial(
                parse_adapter,
                files.config,
                files.weights,
                model_config,
                max_rank=settings.max_lora_rank,
                max_bytes=settings.max_adapter_upload_bytes,
            )
        )

    async def _draft_model_config(self, base: BaseModel) -> ModelConfig:
        """The ModelConfig of the draft model `base` is served with, which a draft counterpart must fit; 400 when it
        has none (a counterpart would never run)."""
        speculative = SpeculativeConfig.parse(base.speculative_config) if base.speculative_config else None
        if speculative is None or speculative.method != "draft_model" or speculative.model is None:
            raise invalid_request(
                f"Base model '{base.name}' has no draft model to run a draft counterpart on (its engines do not "
                f"speculate with a draft model); upload the adapter without {' and '.join(DRAFT_FILES)}.",
                param=DRAFT_CONFIG_FILE,
                code="invalid_adapter",
            )
        try:
            return await self._resources.model_configs.of(str(speculative.model))
        except CheckpointError:
            # The admin's draft checkpoint, not the upload, is at fault; its path is none of the tenant's business.
            logger.exception("the draft model %s of base model %s cannot be read", speculative.model, base.name)
            raise ApiError(
                503,
                f"The draft model of base model '{base.name}' cannot be read now, so the draft counterpart cannot be "
                "checked; nothing was saved. Try again later, or upload the adapter without its draft counterpart.",
                code="draft_model_unavailable",
            ) from None

    async def _store(self, files: Sequence[tuple[str, bytes]]) -> None:
        """Put every (key, data), or (deleting whatever was put) raise 503."""
        keys = [key for key, _ in files]
        try:
            for key, data in files:
                await self._resources.objects.put(key, data, content_type=_CONTENT_TYPES[key.rpartition("/")[2]])
        except BaseException as exc:
            # Every key, the failed one too: a put whose answer was lost may still have landed.
            await self._delete_keys(keys)
            if isinstance(exc, ObjectStoreError):
                logger.exception("storing adapter files %s failed", keys)
                raise ApiError(
                    503, "The adapter could not be stored; nothing was saved. Try again.", code="storage_unavailable"
                ) from None
            raise

    async def _add_next_version(self, adapter: Adapter) -> Adapter:
        for _ in range(_MAX_VERSION_ATTEMPTS):
            adapter.version = await self._adapters.latest_version(adapter.name, TenantId(adapter.tenant_id)) + 1
            try:
                async with self._session.begin_nested():
                    return await self._adapters.add(adapter)
            except IntegrityError:
                # The savepoint's rollback made `adapter` transient again; the next attempt adds it anew.
                continue
        raise conflict(
            f"Other uploads of '{adapter.name}' took every version this upload tried; try again.", param="name"
        )

    async def _delete_keys(self, keys: Iterable[str]) -> None:
        # Shielded: this is cleanup after a failure or a cancellation, and it must run to the end.
        with anyio.CancelScope(shield=True):
            for key in keys:
                try:
                    await self._resources.objects.delete(key)
                except Exception:
                    logger.exception("could not delete %s; it is left behind", key)
