"""HTTP for base models: an admin registers them and sets how they speculate and reason; tenants see them in
/v1/models."""

from __future__ import annotations

from litestar import Controller, get, patch, post
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.base_models.schemas import BaseModelCreate, BaseModelOut, BaseModelPatch
from loraplex.platform.domain.base_models.service import BaseModelService
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import ObjectList


async def register_base_model(db: AsyncSession, resources: Resources, data: BaseModelCreate) -> BaseModelOut:
    """Register and commit a base model (the API's and the console's way)."""
    service = BaseModelService(db, resources.model_configs)
    row = await service.create(
        data.name,
        data.source,
        data.quantization.value if data.quantization else None,
        data.speculative_config,
        data.reasoning_config,
    )
    await db.commit()
    return BaseModelOut.of(row)


async def update_base_model(db: AsyncSession, resources: Resources, name: str, data: BaseModelPatch) -> BaseModelOut:
    """Apply and commit `data` to the base model `name` (the API's and the console's way): the fields it gives, all
    or (on a refusal) none of them."""
    service = BaseModelService(db, resources.model_configs)
    row = await service.named(name)
    if "speculative_config" in data.model_fields_set:
        row = await service.set_speculative_config(name, data.speculative_config)
    if "reasoning_config" in data.model_fields_set:
        row = await service.set_reasoning_config(name, data.reasoning_config)
    await db.commit()
    embedded = resources.embedded_engine
    if "reasoning_config" in data.model_fields_set and embedded is not None and embedded.model_name == row.name:
        # Reasoning needs no restart: the in-process engine serves the new settings from its next request, so the
        # budgets the platform now sends always meet an engine that can hold them.
        embedded.set_reasoning(row.reasoning())
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

    # `:path`, since a base model's name may hold slashes (`meta-llama/Llama-3.2-1B`); the value starts with one.
    @get("/{name:path}", summary="Get a base model")
    async def get(self, name: FromPath[str], db: DbSession, resources: AppResources) -> BaseModelOut:
        row = await BaseModelService(db, resources.model_configs).named(name.removeprefix("/"))
        return BaseModelOut.of(row)

    @patch(
        "/{name:path}",
        summary="Set or clear a base model's speculative config (engines take it when they start) or reasoning "
        "config (at once in the embedded engine; fleet engines take --reasoning-parser when they start)",
    )
    async def update(
        self, name: FromPath[str], data: JSONBody[BaseModelPatch], db: DbSession, resources: AppResources
    ) -> BaseModelOut:
        return await update_base_model(db, resources, name.removeprefix("/"), data)
