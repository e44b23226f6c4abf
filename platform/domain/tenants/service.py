"""Tenant logic. Stateless and never commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page
from loraplex.platform.domain.tenants.models import MAX_FAIRNESS_WEIGHT, Tenant, TenantStatus
from loraplex.platform.domain.tenants.repository import TenantRepository
from loraplex.platform.domain.tenants.schemas import LIMIT_FIELDS
from loraplex.platform.errors import conflict, invalid_request, not_found
from loraplex.platform.ids import TenantId
from loraplex.platform.service_tiers import ServiceTier, canonical_tiers


@dataclass(frozen=True, slots=True)
class TenantUpdate:
    tenant: Tenant
    status_changed: bool


class TenantService:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session
        self._tenants = TenantRepository(session)

    async def create(
        self,
        name: str,
        *,
        fairness_weight: float = 1.0,
        service_tiers: Sequence[ServiceTier] | None = None,
        limits: Mapping[str, int | None] | None = None,
    ) -> Tenant:
        """A new active tenant; `service_tiers` None: the platform's default; `limits` as in `update`."""
        _check_terms(fairness_weight, limits)
        if await self._tenants.get_by_name(name) is not None:
            raise conflict(f"A tenant named '{name}' already exists.", param="name")
        tenant = Tenant(
            name=name,
            status=TenantStatus.ACTIVE.value,
            fairness_weight=fairness_weight,
            service_tiers=_stored_tiers(service_tiers),
            **(limits or {}),
        )
        try:
            async with self._session.begin_nested():
                return await self._tenants.add(tenant)
        except IntegrityError:
            raise conflict(f"A tenant named '{name}' already exists.", param="name") from None

    async def get(self, tenant_id: TenantId) -> Tenant:
        tenant = await self._tenants.get(tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id)
        return tenant

    async def list(self, *, limit: int, after: TenantId | None) -> Page[Tenant]:
        return await self._tenants.list(limit=limit, after=after)

    async def update(
        self,
        tenant_id: TenantId,
        *,
        name: str | None = None,
        status: TenantStatus | None = None,
        fairness_weight: float | None = None,
        service_tiers: Sequence[ServiceTier] | None = None,
        reset_service_tiers: bool = False,
        limits: Mapping[str, int | None] | None = None,
    ) -> TenantUpdate:
        """Change what is given; `reset_service_tiers` returns the tenant to the platform's default tiers; `limits`
        maps limit columns (schemas.LIMIT_FIELDS) to a value or None (the default)."""
        if reset_service_tiers and service_tiers is not None:
            raise ValueError("give service_tiers or reset_service_tiers, not both")
        _check_terms(fairness_weight, limits)
        tenant = await self.get(tenant_id)
        if name is not None and name != tenant.name:
            if await self._tenants.get_by_name(name) is not None:
                raise conflict(f"A tenant named '{name}' already exists.", param="name")
            tenant.name = name
        status_changed = status is not None and status.value != tenant.status
        if status is not None:
            tenant.status = status.value
        if fairness_weight is not None:
            tenant.fairness_weight = fairness_weight
        if service_tiers is not None or reset_service_tiers:
            tenant.service_tiers = _stored_tiers(service_tiers)
        for column, value in (limits or {}).items():
            setattr(tenant, column, value)
        try:
            async with self._session.begin_nested():
                await self._session.flush()
        except IntegrityError:
            raise conflict(f"A tenant named '{name}' already exists.", param="name") from None
        return TenantUpdate(tenant=tenant, status_changed=status_changed)


def _check_terms(fairness_weight: float | None, limits: Mapping[str, int | None] | None) -> None:
    """Refuse what the edge (schemas) already refuses, for callers that are not the edge: the database's checks would
    otherwise surface as an IntegrityError that reads like a name conflict."""
    unknown = set(limits or {}) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"not limits of a tenant: {sorted(unknown)}")
    if fairness_weight is not None and not 0 < fairness_weight <= MAX_FAIRNESS_WEIGHT:
        raise invalid_request(
            f"'fairness_weight' must be above 0 and at most {MAX_FAIRNESS_WEIGHT:g}.", param="fairness_weight"
        )


def _stored_tiers(tiers: Sequence[ServiceTier] | None) -> list[str] | None:
    """The service_tiers column's value: the canonical list as plain strings (JSON), or None for the default."""
    if tiers is None:
        return None
    try:
        return [tier.value for tier in canonical_tiers(tiers)]
    except ValueError as exc:
        raise invalid_request(f"'service_tiers': {exc}.", param="service_tiers") from None
