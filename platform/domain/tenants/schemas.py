"""Tenant shapes at the edge: `{id, name, status, created_at, limits}`."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from loraplex.platform.domain.tenants.models import Tenant, TenantStatus
from loraplex.platform.schemas import Name, RequestBody, from_json_string

# The rate limit columns of a tenant, as named in `limits` (the same names as the columns).
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "key_requests_per_minute", "key_tokens_per_minute")

PerMinute = Annotated[int, Field(ge=1, le=10**12)]


class TenantLimits(BaseModel):
    """Per-minute limits set by an admin; null means the platform's default (for the key limits: the tenant's)."""

    requests_per_minute: int | None = Field(description="Requests per minute of the whole tenant.")
    tokens_per_minute: int | None = Field(
        description="Tokens per minute of the whole tenant (a request counts prompt tokens + max_tokens)."
    )
    key_requests_per_minute: int | None = Field(description="Requests per minute of each API key.")
    key_tokens_per_minute: int | None = Field(description="Tokens per minute of each API key.")

    @classmethod
    def of(cls, tenant: Tenant) -> TenantLimits:
        return cls(
            requests_per_minute=tenant.requests_per_minute,
            tokens_per_minute=tenant.tokens_per_minute,
            key_requests_per_minute=tenant.key_requests_per_minute,
            key_tokens_per_minute=tenant.key_tokens_per_minute,
        )


class TenantOut(BaseModel):
    id: uuid.UUID
    name: str
    status: TenantStatus
    created_at: datetime
    limits: TenantLimits

    @classmethod
    def of(cls, tenant: Tenant) -> TenantOut:
        return cls(
            id=tenant.id,
            name=tenant.name,
            status=TenantStatus(tenant.status),
            created_at=tenant.created_at,
            limits=TenantLimits.of(tenant),
        )


class TenantCreate(RequestBody):
    name: Name


class TenantLimitsPatch(RequestBody):
    """The limits to change: a number sets one, null returns it to the default, an absent field stays as it is."""

    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    key_requests_per_minute: PerMinute | None = None
    key_tokens_per_minute: PerMinute | None = None

    @model_validator(mode="after")
    def _something(self) -> TenantLimitsPatch:
        if not self.model_fields_set:
            raise ValueError(f"give at least one of {', '.join(LIMIT_FIELDS)}")
        return self

    def changes(self) -> dict[str, int | None]:
        """Column name -> new value (None: back to the default), for the fields the request gave."""
        return {name: getattr(self, name) for name in LIMIT_FIELDS if name in self.model_fields_set}


class TenantPatch(RequestBody):
    name: Name | None = None
    status: Annotated[TenantStatus, from_json_string(TenantStatus)] | None = None
    limits: TenantLimitsPatch | None = None

    @model_validator(mode="after")
    def _something(self) -> TenantPatch:
        if self.name is None and self.status is None and self.limits is None:
            raise ValueError("give at least one of name, status, limits")
        return self
