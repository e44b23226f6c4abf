"""Endpoint logic: an endpoint names a base model and (optionally) one of the tenant's ready adapters for it.
Stateless; never commits."""

from __future__ import annotations

import builtins
import uuid

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import MAX_PAGE_SIZE, Page
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.adapters.repository import AdapterRepository
from loraplex.platform.domain.adapters.service import require_ready
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.domain.endpoints.repository import EndpointRepository
from loraplex.platform.domain.endpoints.schemas import EndpointCreate, EndpointOut
from loraplex.platform.errors import conflict, invalid_request, not_found
from loraplex.platform.ids import TenantId


class EndpointService:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session
        self._endpoints = EndpointRepository(session)
        self._adapters = AdapterRepository(session)
        self._base_models = BaseModelRepository(session)

    async def create(self, tenant_id: TenantId, data: EndpointCreate) -> tuple[Endpoint, BaseModel]:
        base = await self._base_models.get_by_name(data.base_model)
        if base is None:
            raise invalid_request(f"No base model named '{data.base_model}'.", param="base_model")
        if data.adapter_id is not None:
            adapter = await self._adapters.get_readable_by_id(data.adapter_id, tenant_id)
            if adapter is None:
                raise not_found("adapter", data.adapter_id)
            self._check_adapter(adapter, base)
        if await self._endpoints.get_by_name(data.name, tenant_id) is not None:
            raise conflict(f"You already have an endpoint named '{data.name}'.", param="name")
        endpoint = Endpoint(
            tenant_id=tenant_id,
            name=data.name,
            base_model_id=base.id,
            adapter_id=data.adapter_id,
            defaults=data.defaults.model_dump(exclude_none=True),
        )
        try:
            async with self._session.begin_nested():
                return await self._endpoints.add(endpoint), base
        except IntegrityError:
            raise conflict(f"You already have an endpoint named '{data.name}'.", param="name") from None

    @staticmethod
    def _check_adapter(adapter: Adapter, base: BaseModel) -> None:
        require_ready(adapter, param="adapter_id")
        if adapter.base_model_id != base.id:
            raise invalid_request(
                f"Adapter '{adapter.name}' was made for another base model than '{base.name}'.", param="adapter_id"
            )

    async def get(self, endpoint_id: uuid.UUID, tenant_id: TenantId) -> Endpoint:
        endpoint = await self._endpoints.get_readable_by_id(endpoint_id, tenant_id)
        if endpoint is None:
            raise not_found("endpoint", endpoint_id)
        return endpoint

    async def list(self, tenant_id: TenantId, *, limit: int, after: uuid.UUID | None) -> Page[Endpoint]:
        return await self._endpoints.list_for_tenant(tenant_id, limit=limit, after=after)

    async def list_all(self, tenant_id: TenantId) -> builtins.list[Endpoint]:
        """Every endpoint of the tenant, newest first: what lists of the models a tenant can name show (a model
        missing from such a list looks like a 404 later)."""
        endpoints: builtins.list[Endpoint] = []
        while True:
            page = await self.list(tenant_id, limit=MAX_PAGE_SIZE, after=endpoints[-1].id if endpoints else None)
            endpoints += page.items
            if not page.has_more:
                return endpoints

    async def delete(self, endpoint_id: uuid.UUID, tenant_id: TenantId) -> None:
        await self._endpoints.delete(await self.get(endpoint_id, tenant_id))

    async def out(self, endpoint: Endpoint) -> EndpointOut:
        base = await self._base_models.get(endpoint.base_model_id)
        return EndpointOut(
            id=endpoint.id,
            name=endpoint.name,
            base_model=base.name if base else "",
            adapter_id=endpoint.adapter_id,
            defaults=dict(endpoint.defaults or {}),
            status=endpoint.status,
            created_at=endpoint.created_at,
        )
