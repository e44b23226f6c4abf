"""Every query on tenants."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page, fetch_page
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.ids import TenantId


class TenantRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, tenant_id: TenantId) -> Tenant | None:
        return await self._session.get(Tenant, tenant_id)

    async def get_by_name(self, name: str) -> Tenant | None:
        tenant: Tenant | None = await self._session.scalar(select(Tenant).where(Tenant.name == name))
        return tenant

    async def list(self, *, limit: int, after: TenantId | None) -> Page[Tenant]:
        """All tenants (admin only)."""
        return await fetch_page(self._session, Tenant, select(Tenant), limit=limit, after=after)

    async def add(self, tenant: Tenant) -> Tenant:
        self._session.add(tenant)
        await self._session.flush()
        return tenant
