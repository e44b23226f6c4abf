"""HTTP for tenants: admin management under /admin/tenants, and /v1/me for a tenant's own view."""

from __future__ import annotations

import uuid

from litestar import Controller, get, patch, post
from litestar.params import FromPath, FromQuery, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import AppResources, DbSession, Principal
from loraplex.platform.domain.tenants.schemas import TenantCreate, TenantOut, TenantPatch
from loraplex.platform.domain.tenants.service import TenantService
from loraplex.platform.ids import TenantId
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import ObjectList, PageLimit


async def create_tenant(db: AsyncSession, resources: Resources, data: TenantCreate) -> TenantOut:
    """Create and commit a tenant (the API's and the console's way)."""
    tenant = await TenantService(db).create(
        data.name,
        fairness_weight=data.fairness_weight,
        service_tiers=data.service_tiers,
        limits=data.limits.changes() if data.limits is not None else None,
    )
    await db.commit()
    return TenantOut.of(tenant, resources.settings.default_service_tiers)


async def update_tenant(db: AsyncSession, resources: Resources, tenant_id: TenantId, data: TenantPatch) -> TenantOut:
    """Apply and commit `data` (the API's and the console's way); a changed status is then told to every replica,
    which ends the tenant's API access and console sessions (or lets them in again) at their next request."""
    result = await TenantService(db).update(
        tenant_id,
        name=data.name,
        status=data.status,
        fairness_weight=data.fairness_weight,
        service_tiers=data.service_tiers,
        reset_service_tiers=data.resets_service_tiers,
        limits=data.limits.changes() if data.limits is not None else None,
    )
    await db.commit()
    if result.status_changed:
        # After the commit: every replica's next request sees the new status.
        await resources.authenticator.tenant_changed(tenant_id, result.tenant.status)
    return TenantOut.of(result.tenant, resources.settings.default_service_tiers)


class AdminTenantController(Controller):
    path = "/tenants"
    tags = ["admin: tenants"]

    @post("/", status_code=201, summary="Create a tenant")
    async def create(self, data: JSONBody[TenantCreate], db: DbSession, resources: AppResources) -> TenantOut:
        return await create_tenant(db, resources, data)

    @get("/", summary="List tenants, newest first")
    async def list(
        self,
        db: DbSession,
        resources: AppResources,
        limit: PageLimit = 20,
        after: FromQuery[uuid.UUID | None] = None,
    ) -> ObjectList[TenantOut]:
        page = await TenantService(db).list(limit=limit, after=TenantId(after) if after else None)
        default_tiers = resources.settings.default_service_tiers
        return ObjectList.of([TenantOut.of(t, default_tiers) for t in page.items], has_more=page.has_more)

    @get("/{tenant_id:uuid}", summary="Get a tenant")
    async def get(self, tenant_id: FromPath[uuid.UUID], db: DbSession, resources: AppResources) -> TenantOut:
        tenant = await TenantService(db).get(TenantId(tenant_id))
        return TenantOut.of(tenant, resources.settings.default_service_tiers)

    @patch(
        "/{tenant_id:uuid}",
        summary="Rename, suspend or reactivate a tenant, or set its fair-share weight, service tiers or limits",
    )
    async def update(
        self, tenant_id: FromPath[uuid.UUID], data: JSONBody[TenantPatch], db: DbSession, resources: AppResources
    ) -> TenantOut:
        return await update_tenant(db, resources, TenantId(tenant_id), data)


class TenantSelfController(Controller):
    path = "/me"
    tags = ["tenant"]

    @get("/", summary="The tenant this API key belongs to")
    async def me(self, principal: Principal, db: DbSession, resources: AppResources) -> TenantOut:
        tenant = await TenantService(db).get(principal.tenant_id)
        return TenantOut.of(tenant, resources.settings.default_service_tiers)
