"""HTTP for API keys: a tenant's own under /v1/api-keys; any tenant's under /admin."""

from __future__ import annotations

import uuid

from litestar import Controller, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import AppResources, DbSession, Principal
from loraplex.platform.domain.api_keys.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyOut
from loraplex.platform.domain.api_keys.service import ApiKeyService
from loraplex.platform.ids import ApiKeyId, TenantId
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import ObjectList, PageLimit


async def create_api_key(
    db: AsyncSession, resources: Resources, tenant_id: TenantId, data: ApiKeyCreate | None
) -> ApiKeyCreated:
    """Create and commit a tenant's key (the API's and the console's way)."""
    row, new_key = await ApiKeyService(db, resources.hasher).create(tenant_id, name=data.name if data else None)
    await db.commit()
    return ApiKeyCreated.created(row, new_key)


async def revoke_api_key(db: AsyncSession, resources: Resources, key_id: str, tenant_id: TenantId | None) -> ApiKeyOut:
    """Revoke and commit a key (`tenant_id`: only that tenant's), then tell every replica."""
    key = await ApiKeyService(db, resources.hasher).revoke(ApiKeyId(key_id), tenant_id=tenant_id)
    await db.commit()
    # After the commit: every replica's next request with this key is refused.
    await resources.authenticator.key_changed(ApiKeyId(key.id))
    return ApiKeyOut.of(key)


class AdminApiKeyController(Controller):
    path = "/"
    tags = ["admin: api keys"]

    @post("/tenants/{tenant_id:uuid}/api-keys", status_code=201, summary="Create an API key for a tenant")
    async def create(
        self,
        tenant_id: FromPath[uuid.UUID],
        db: DbSession,
        resources: AppResources,
        data: JSONBody[ApiKeyCreate | None] = None,
    ) -> ApiKeyCreated:
        return await create_api_key(db, resources, TenantId(tenant_id), data)

    @delete("/api-keys/{key_id:str}", status_code=200, summary="Revoke any tenant's API key")
    async def revoke(self, key_id: FromPath[str], db: DbSession, resources: AppResources) -> ApiKeyOut:
        return await revoke_api_key(db, resources, key_id, None)


class TenantApiKeyController(Controller):
    path = "/api-keys"
    tags = ["tenant"]

    @post("/", status_code=201, summary="Create an API key for your tenant (the key is shown once)")
    async def create(
        self,
        principal: Principal,
        db: DbSession,
        resources: AppResources,
        data: JSONBody[ApiKeyCreate | None] = None,
    ) -> ApiKeyCreated:
        return await create_api_key(db, resources, principal.tenant_id, data)

    @get("/", summary="List your API keys, newest first")
    async def list(
        self,
        principal: Principal,
        db: DbSession,
        resources: AppResources,
        limit: PageLimit = 20,
        after: FromQuery[str | None] = None,
    ) -> ObjectList[ApiKeyOut]:
        page = await ApiKeyService(db, resources.hasher).list(
            principal.tenant_id, limit=limit, after=ApiKeyId(after) if after else None
        )
        return ObjectList.of([ApiKeyOut.of(k) for k in page.items], has_more=page.has_more)

    @delete("/{key_id:str}", status_code=200, summary="Revoke one of your API keys")
    async def revoke(
        self, key_id: FromPath[str], principal: Principal, db: DbSession, resources: AppResources
    ) -> ApiKeyOut:
        return await revoke_api_key(db, resources, key_id, principal.tenant_id)
