"""HTTP for a tenant's endpoints under /v1/endpoints."""

from __future__ import annotations

import uuid

from litestar import Controller, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody

from loraplex.platform.dependencies import DbSession, Principal
from loraplex.platform.domain.endpoints.schemas import EndpointCreate, EndpointDeleted, EndpointOut
from loraplex.platform.domain.endpoints.service import EndpointService
from loraplex.platform.schemas import ObjectList, PageLimit


class EndpointController(Controller):
    path = "/endpoints"
    tags = ["tenant: endpoints"]

    @post("/", status_code=201, summary="Create an endpoint: a name for a base model and optionally an adapter")
    async def create(self, data: JSONBody[EndpointCreate], principal: Principal, db: DbSession) -> EndpointOut:
        service = EndpointService(db)
        endpoint, _ = await service.create(principal.tenant_id, data)
        await db.commit()
        return await service.out(endpoint)

    @get("/", summary="List your endpoints, newest first")
    async def list(
        self, principal: Principal, db: DbSession, limit: PageLimit = 20, after: FromQuery[uuid.UUID | None] = None
    ) -> ObjectList[EndpointOut]:
        service = EndpointService(db)
        page = await service.list(principal.tenant_id, limit=limit, after=after)
        return ObjectList.of([await service.out(e) for e in page.items], has_more=page.has_more)

    @get("/{endpoint_id:uuid}", summary="Get one of your endpoints")
    async def get(self, endpoint_id: FromPath[uuid.UUID], principal: Principal, db: DbSession) -> EndpointOut:
        service = EndpointService(db)
        return await service.out(await service.get(endpoint_id, principal.tenant_id))

    @delete("/{endpoint_id:uuid}", status_code=200, summary="Delete one of your endpoints")
    async def delete(self, endpoint_id: FromPath[uuid.UUID], principal: Principal, db: DbSession) -> EndpointDeleted:
        await EndpointService(db).delete(endpoint_id, principal.tenant_id)
        await db.commit()
        return EndpointDeleted(id=endpoint_id)
