"""API key logic: minting, listing, revoking. Stateless and never commits: the caller owns the transaction.

The full key exists only in the value returned by `create*`; the database keeps its keyed hash.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.pagination import Page
from loraplex.platform.domain.api_keys.keys import KeyHasher, KeyKind, NewKey, generate_key
from loraplex.platform.domain.api_keys.models import AdminKey, ApiKey
from loraplex.platform.domain.api_keys.repository import AdminKeyRepository, ApiKeyRepository
from loraplex.platform.domain.tenants.repository import TenantRepository
from loraplex.platform.errors import not_found
from loraplex.platform.ids import ApiKeyId, TenantId


class ApiKeyService:
    def __init__(self, session: AsyncSession, hasher: KeyHasher) -> None:
        self._keys = ApiKeyRepository(session)
        self._admin_keys = AdminKeyRepository(session)
        self._tenants = TenantRepository(session)
        self._hasher = hasher

    async def create(self, tenant_id: TenantId, *, name: str | None) -> tuple[ApiKey, NewKey]:
        if await self._tenants.get(tenant_id) is None:
            raise not_found("tenant", tenant_id)
        new_key = generate_key(KeyKind.TENANT)
        row = ApiKey(
            id=new_key.key_id,
            tenant_id=tenant_id,
            name=name,
            key_hash=self._hasher.hash(new_key.full_key),
        )
        return await self._keys.add(row), new_key

    async def list(self, tenant_id: TenantId, *, limit: int, after: ApiKeyId | None) -> Page[ApiKey]:
        return await self._keys.list_for_tenant(tenant_id, limit=limit, after=after)

    async def revoke(self, key_id: ApiKeyId, *, tenant_id: TenantId | None) -> ApiKey:
        """Revoke a key; `tenant_id=None` means any tenant's (admin). Revoking twice keeps the first time."""
        key = await (
            self._keys.get_any(key_id) if tenant_id is None else self._keys.get_readable_by_id(key_id, tenant_id)
        )
        if key is None:
            raise not_found("API key", key_id)
        if key.revoked_at is None:
            key.revoked_at = utcnow()
        return key

    async def create_admin_key(self, *, name: str | None) -> tuple[AdminKey, NewKey]:
        new_key = generate_key(KeyKind.ADMIN)
        row = AdminKey(id=new_key.key_id, name=name, key_hash=self._hasher.hash(new_key.full_key))
        return await self._admin_keys.add(row), new_key
