"""HTTP for base models: an admin registers them; tenants see them in /v1/models."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.params import JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.base_models.schemas import BaseModelCreate, BaseModelOut
from loraplex.platform.domain.base_models.service import BaseModelService
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import ObjectList


async def register_base_model(db: AsyncSession, resources: Resources, data: BaseModelCreate) -> BaseModelOut:
    """Register and commit a base model (the API's and the console's way)."""
    service = BaseModelService(db, resources.model_configs)
    row = await service.create(data.name, data.source, data.quantization.value if data.quantization else None)
    await db.commit()
    return BaseModelOut.of(row)


class AdminBaseModelController(Controller):
    path = "/base-models"
    tags = ["admin: base models"]

    @post("/", status_code=201, summary="Register a base model (a Llama-family checkpoint folder or s3:// URI)")
    async def create(self, data: JSONBody[BaseModelCreate], db: DbSession, resources: AppResources) -> BaseModelOut:
        return await register_base_model(db, resources, data)

    @get("/", summary="List base models")
    async def list(self, db: DbSession, resources: AppResources) -> ObjectList[BaseModelOut]:
        rows = await BaseModelService(db, resources.model_configs).list()
        return ObjectList(data=[BaseModelOut.of(r) for r in rows])
