"""Every query on adapters; every read takes the tenant id, except the admin's `list_by_digests`."""

from __future__ import annotations

import uuid
from collections.abc import Collection

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page, fetch_page
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.ids import TenantId


class AdapterRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get_readable_by_id(self, adapter_id: uuid.UUID, tenant_id: TenantId) -> Adapter | None:
        found: Adapter | None = await self._session.scalar(
            select(Adapter).where(Adapter.id == adapter_id, Adapter.tenant_id == tenant_id)
        )
        return found

    async def list_for_tenant(
        self, tenant_id: TenantId, *, limit: int, after: uuid.UUID | None, name: str | None = None
    ) -> Page[Adapter]:
        """Newest first; with `name`, only that adapter's versions."""
        query = select(Adapter).where(Adapter.tenant_id == tenant_id)
        if name is not None:
            query = query.where(Adapter.name == name)
        return await fetch_page(self._session, Adapter, query, limit=limit, after=after)

    async def latest_version(self, name: str, tenant_id: TenantId) -> int:
        latest = await self._session.scalar(
            select(func.max(Adapter.version)).where(Adapter.name == name, Adapter.tenant_id == tenant_id)
        )
        return int(latest or 0)

    async def list_by_digests(self, digests: Collection[str]) -> list[tuple[Adapter, str]]:
        """Every tenant's adapters with one of these content digests, with the tenant's name (admin only); by tenant
        name, name and version. Two rows may share a digest (the same files uploaded twice)."""
        if not digests:
            return []
        rows = await self._session.execute(
            select(Adapter, Tenant.name)
            .join(Tenant, Tenant.id == Adapter.tenant_id)
            .where(Adapter.digest.in_(list(digests)))
            .order_by(Tenant.name, Adapter.name, Adapter.version)
        )
        return [(adapter, tenant_name) for adapter, tenant_name in rows]

    async def add(self, adapter: Adapter) -> Adapter:
        self._session.add(adapter)
        await self._session.flush()
        return adapter

    async def delete(self, adapter: Adapter) -> None:
        await self._session.delete(adapter)
        await self._session.flush()
