"""Every query on base models (a catalogue every tenant reads; only admins write)."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.base_models.models import BaseModel


class BaseModelRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, base_model_id: uuid.UUID) -> BaseModel | None:
        return await self._session.get(BaseModel, base_model_id)

    async def get_by_name(self, name: str) -> BaseModel | None:
        found: BaseModel | None = await self._session.scalar(select(BaseModel).where(BaseModel.name == name))
        return found

    async def list(self) -> list[BaseModel]:
        return list((await self._session.scalars(select(BaseModel).order_by(BaseModel.name))).all())

    async def add(self, base_model: BaseModel) -> BaseModel:
        self._session.add(base_model)
        await self._session.flush()
        return base_model
