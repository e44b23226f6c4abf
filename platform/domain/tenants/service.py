"""Tenant logic. Stateless and never commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page
from loraplex.platform.domain.tenants.models import Tenant, TenantStatus
from loraplex.platform.domain.tenants.repository import TenantRepository
from loraplex.platform.domain.tenants.schemas import LIMIT_FIELDS
from loraplex.platform.errors import conflict, not_found
from loraplex.platform.ids import TenantId


@dataclass(frozen=True, slots=True)
class TenantUpdate:
    tenant: Tenant
    status_changed: bool


class TenantService:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session
        self._tenants = TenantRepository(session)

    async def create(self, name: str) -> Tenant:
        if await self._tenants.get_by_name(name) is not None:
            raise conflict(f"A tenant named '{name}' already exists.", param="name")
        try:
            async with self._session.begin_nested():
                return await self._tenants.add(Tenant(name=name, status=TenantStatus.ACTIVE.value))
        except IntegrityError:
            raise conflict(f"A tenant named '{name}' already exists.", param="name") from None

    async def get(self, tenant_id: TenantId) -> Tenant:
        tenant = await self._tenants.get(tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id)
        return tenant

    async def list(self, *, limit: int, after: TenantId | None) -> Page[Tenant]:
        return await self._tenants.list(limit=limit, after=after)

    async def update(
        self,
        tenant_id: TenantId,
        *,
        name: str | None = None,
        status: TenantStatus | None = None,
        limits: Mapping[str, int | None] | None = None,
    ) -> TenantUpdate:
        """Change what is given; `limits` maps rate limit columns (schemas.LIMIT_FIELDS) to a value or None (the
        default)."""
        unknown = set(limits or {}) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"not rate limits of a tenant: {sorted(unknown)}")
        tenant = await self.get(tenant_id)
        if name is not None and name != tenant.name:
            if await self._tenants.get_by_name(name) is not None:
                raise conflict(f"A tenant named '{name}' already exists.", param="name")
            tenant.name = name
        status_changed = status is not None and status.value != tenant.status
        if status is not None:
            tenant.status = status.value
        for column, value in (limits or {}).items():
            setattr(tenant, column, value)
        try:
            async with self._session.begin_nested():
                await self._session.flush()
        except IntegrityError:
            raise conflict(f"A tenant named '{name}' already exists.", param="name") from None
        return TenantUpdate(tenant=tenant, status_changed=status_changed)
