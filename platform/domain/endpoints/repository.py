"""Every query on endpoints; every read takes the tenant id."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page, fetch_page
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.ids import TenantId


class EndpointRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get_readable_by_id(self, endpoint_id: uuid.UUID, tenant_id: TenantId) -> Endpoint | None:
        found: Endpoint | None = await self._session.scalar(
            select(Endpoint).where(Endpoint.id == endpoint_id, Endpoint.tenant_id == tenant_id)
        )
        return found

    async def get_by_name(self, name: str, tenant_id: TenantId) -> Endpoint | None:
        found: Endpoint | None = await self._session.scalar(
            select(Endpoint).where(Endpoint.name == name, Endpoint.tenant_id == tenant_id)
        )
        return found

    async def list_for_tenant(self, tenant_id: TenantId, *, limit: int, after: uuid.UUID | None) -> Page[Endpoint]:
        query = select(Endpoint).where(Endpoint.tenant_id == tenant_id)
        return await fetch_page(self._session, Endpoint, query, limit=limit, after=after)

    async def count_using_adapter(self, adapter_id: uuid.UUID, tenant_id: TenantId) -> int:
        count = await self._session.scalar(
            select(func.count()).where(Endpoint.adapter_id == adapter_id, Endpoint.tenant_id == tenant_id)
        )
        return int(count or 0)

    async def add(self, endpoint: Endpoint) -> Endpoint:
        self._session.add(endpoint)
        await self._session.flush()
        return endpoint

    async def delete(self, endpoint: Endpoint) -> None:
        await self._session.delete(endpoint)
        await self._session.flush()
