"""Every query on tenant API keys and admin keys. Tenant reads take the tenant id as a required argument."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page, fetch_page
from loraplex.platform.domain.api_keys.models import AdminKey, ApiKey
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.ids import AdminKeyId, ApiKeyId, TenantId


@dataclass(frozen=True, slots=True)
class KeyForAuthentication:
    """What authentication needs to know about a presented key, read in one query."""

    key_id: ApiKeyId
    tenant_id: TenantId
    key_hash: str
    revoked: bool
    tenant_status: str


class ApiKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get_readable_by_id(self, key_id: ApiKeyId, tenant_id: TenantId) -> ApiKey | None:
        key: ApiKey | None = await self._session.scalar(
            select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)
        )
        return key

    async def list_for_tenant(self, tenant_id: TenantId, *, limit: int, after: ApiKeyId | None) -> Page[ApiKey]:
        query = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
        return await fetch_page(self._session, ApiKey, query, limit=limit, after=after)

    async def get_any(self, key_id: ApiKeyId) -> ApiKey | None:
        """Any tenant's key: for the admin API only."""
        return await self._session.get(ApiKey, key_id)

    async def get_for_authentication(self, key_id: ApiKeyId) -> KeyForAuthentication | None:
        row = (
            await self._session.execute(
                select(ApiKey.tenant_id, ApiKey.key_hash, ApiKey.revoked_at, Tenant.status)
                .join(Tenant, Tenant.id == ApiKey.tenant_id)
                .where(ApiKey.id == key_id)
            )
        ).one_or_none()
        if row is None:
            return None
        return KeyForAuthentication(
            key_id=key_id,
            tenant_id=TenantId(row.tenant_id),
            key_hash=row.key_hash,
            revoked=row.revoked_at is not None,
            tenant_status=row.status,
        )

    async def add(self, key: ApiKey) -> ApiKey:
        self._session.add(key)
        await self._session.flush()
        return key


class AdminKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, key_id: AdminKeyId) -> AdminKey | None:
        return await self._session.get(AdminKey, key_id)

    async def add(self, key: AdminKey) -> AdminKey:
        self._session.add(key)
        await self._session.flush()
        return key
