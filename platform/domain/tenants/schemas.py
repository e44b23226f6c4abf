"""Tenant shapes at the edge: `{id, name, status, created_at}`."""

from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, model_validator

from loraplex.platform.domain.tenants.models import Tenant, TenantStatus
from loraplex.platform.schemas import Name, RequestBody


class TenantOut(BaseModel):
    id: uuid.UUID
    name: str
    status: TenantStatus
    created_at: datetime

    @classmethod
    def of(cls, tenant: Tenant) -> TenantOut:
        return cls(id=tenant.id, name=tenant.name, status=TenantStatus(tenant.status), created_at=tenant.created_at)


class TenantCreate(RequestBody):
    name: Name


class TenantPatch(RequestBody):
    name: Name | None = None
    status: TenantStatus | None = None

    @model_validator(mode="after")
    def _something(self) -> TenantPatch:
        if self.name is None and self.status is None:
            raise ValueError("give at least one of name, status")
        return self
