"""Tenant shapes at the edge: `{id, name, status, created_at, fairness_weight, service_tiers, limits}`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from loraplex.platform.domain.tenants.models import MAX_FAIRNESS_WEIGHT, Tenant, TenantStatus
from loraplex.platform.schemas import Name, RequestBody, from_json_string
from loraplex.platform.service_tiers import ServiceTier, canonical_tiers

# The limit columns of a tenant, as named in `limits` (the same names as the columns).
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "key_requests_per_minute",
    "key_tokens_per_minute",
    "max_concurrent_requests",
)
MAX_CONCURRENT_REQUESTS = 10**6

# The limits' columns are 32-bit integers (tenants/models.py): a larger value would be a database error, not a 400.
MAX_PER_MINUTE = 2**31 - 1
PerMinute = Annotated[int, Field(ge=1, le=MAX_PER_MINUTE)]
Concurrency = Annotated[int, Field(ge=1, le=MAX_CONCURRENT_REQUESTS)]
FairnessWeight = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_FAIRNESS_WEIGHT,
        allow_inf_nan=False,
        description="The tenant's share of an engine when tenants compete: 2 gets twice the service of 1.",
    ),
]
ServiceTiers = Annotated[
    list[Annotated[ServiceTier, from_json_string(ServiceTier)]],
    Field(
        max_length=len(ServiceTier),
        description="The service tiers the tenant may ask for (`service_tier`): distinct, including default.",
    ),
    AfterValidator(canonical_tiers),
]


class TenantLimits(BaseModel):
    """Per-minute limits set by an admin; null means the platform's default (for the key limits: the tenant's)."""

    requests_per_minute: int | None = Field(description="Requests per minute of the whole tenant.")
    tokens_per_minute: int | None = Field(
        description="Tokens per minute of the whole tenant (a request counts prompt tokens + max_tokens)."
    )
    key_requests_per_minute: int | None = Field(description="Requests per minute of each API key.")
    key_tokens_per_minute: int | None = Field(description="Tokens per minute of each API key.")
    max_concurrent_requests: int | None = Field(
        description="Requests of the tenant that may run at once, across the platform."
    )

    @classmethod
    def of(cls, tenant: Tenant) -> TenantLimits:
        return cls.model_validate({name: getattr(tenant, name) for name in LIMIT_FIELDS})


class TenantOut(BaseModel):
    id: uuid.UUID
    name: str
    status: TenantStatus
    created_at: datetime
    fairness_weight: float = Field(description="The tenant's weight in the engines' fair share (default 1).")
    service_tiers: list[ServiceTier] = Field(
        description="The service tiers the tenant may ask for: its own list, else the platform's default."
    )
    limits: TenantLimits

    @classmethod
    def of(cls, tenant: Tenant, default_service_tiers: Sequence[ServiceTier]) -> TenantOut:
        return cls(
            id=tenant.id,
            name=tenant.name,
            status=TenantStatus(tenant.status),
            created_at=tenant.created_at,
            fairness_weight=tenant.fairness_weight,
            service_tiers=tenant.allowed_service_tiers(default_service_tiers),
            limits=TenantLimits.of(tenant),
        )


class TenantLimitsSet(RequestBody):
    """Limits to set: a number sets one, null (or, at creation, an absent field) leaves it at the default."""

    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    key_requests_per_minute: PerMinute | None = None
    key_tokens_per_minute: PerMinute | None = None
    max_concurrent_requests: Concurrency | None = None

    def changes(self) -> dict[str, int | None]:
        """Column name -> new value (None: back to the default), for the fields the request gave."""
        return {name: getattr(self, name) for name in LIMIT_FIELDS if name in self.model_fields_set}


class TenantLimitsPatch(TenantLimitsSet):
    """The limits to change: a number sets one, null returns it to the default, an absent field stays as it is."""

    @model_validator(mode="after")
    def _something(self) -> TenantLimitsPatch:
        if not self.model_fields_set:
            raise ValueError(f"give at least one of {', '.join(LIMIT_FIELDS)}")
        return self


class TenantCreate(RequestBody):
    name: Name
    fairness_weight: FairnessWeight = 1.0
    service_tiers: ServiceTiers | None = Field(default=None, description="null: the platform's default tiers.")
    limits: TenantLimitsSet | None = None


class TenantPatch(RequestBody):
    """What to change; an absent field stays as it is. `service_tiers: null` returns the tenant to the platform's
    default tiers."""

    name: Name | None = None
    status: Annotated[TenantStatus, from_json_string(TenantStatus)] | None = None
    fairness_weight: FairnessWeight | None = None
    service_tiers: ServiceTiers | None = None
    limits: TenantLimitsPatch | None = None

    @field_validator("fairness_weight")
    @classmethod
    def _not_null(cls, value: float | None) -> float | None:
        # Only an explicit null gets here (an absent field is not validated): a weight has no default to return to.
        if value is None:
            raise ValueError(f"must be a number above 0 and at most {MAX_FAIRNESS_WEIGHT:g} (1 is the usual weight)")
        return value

    @model_validator(mode="after")
    def _something(self) -> TenantPatch:
        given = [self.name, self.status, self.fairness_weight, self.limits]
        if all(value is None for value in given) and "service_tiers" not in self.model_fields_set:
            raise ValueError("give at least one of name, status, fairness_weight, service_tiers, limits")
        return self

    @property
    def resets_service_tiers(self) -> bool:
        """Whether the request gave `service_tiers: null` (back to the platform's default)."""
        return "service_tiers" in self.model_fields_set and self.service_tiers is None
