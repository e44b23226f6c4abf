"""HTTP for tenants: admin management under /admin/tenants, and /v1/me for a tenant's own view."""

from __future__ import annotations

import uuid

from litestar import Controller, get, patch, post
from litestar.params import FromPath, FromQuery, JSONBody

from loraplex.platform.dependencies import AppResources, DbSession, Principal
from loraplex.platform.domain.tenants.schemas import TenantCreate, TenantOut, TenantPatch
from loraplex.platform.domain.tenants.service import TenantService
from loraplex.platform.ids import TenantId
from loraplex.platform.schemas import ObjectList, PageLimit


class AdminTenantController(Controller):
    path = "/tenants"
    tags = ["admin: tenants"]

    @post("/", status_code=201, summary="Create a tenant")
    async def create(self, data: JSONBody[TenantCreate], db: DbSession, resources: AppResources) -> TenantOut:
        tenant = await TenantService(db).create(
            data.name,
            fairness_weight=data.fairness_weight,
            service_tiers=data.service_tiers,
            limits=data.limits.changes() if data.limits is not None else None,
        )
        await db.commit()
        return TenantOut.of(tenant, resources.settings.default_service_tiers)

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
        result = await TenantService(db).update(
            TenantId(tenant_id),
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
            await resources.authenticator.tenant_changed(TenantId(tenant_id), result.tenant.status)
        return TenantOut.of(result.tenant, resources.settings.default_service_tiers)


class TenantSelfController(Controller):
    path = "/me"
    tags = ["tenant"]

    @get("/", summary="The tenant this API key belongs to")
    async def me(self, principal: Principal, db: DbSession, resources: AppResources) -> TenantOut:
        tenant = await TenantService(db).get(principal.tenant_id)
        return TenantOut.of(tenant, resources.settings.default_service_tiers)
