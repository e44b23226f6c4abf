"""Every query of billing: the price book, and usage summed for reports.

Billing is mostly an admin's view across tenants, so these reads take an optional `tenant_id` filter rather than a
required one. The one tenant-facing caller, GET /v1/usage, always passes the caller's own tenant id.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import Date, and_, cast, exists, func, literal_column, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.billing.models import PriceVersion
from loraplex.platform.domain.billing.rating import DEFAULT_TIER, GroupBy, GroupKey, PriceTerms, UsageSlice
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.ids import TenantId


class PriceRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def list(self, base_model: str | None = None) -> list[PriceVersion]:
        """Every version (of `base_model` only, if given), by base model and service tier, newest `effective_at`
        first."""
        query = select(PriceVersion)
        if base_model is not None:
            query = query.where(PriceVersion.base_model == base_model)
        query = query.order_by(PriceVersion.base_model, PriceVersion.service_tier, PriceVersion.effective_at.desc())
        return list((await self._session.scalars(query)).all())

    async def get_at(self, base_model: str, service_tier: str, effective_at: datetime) -> PriceVersion | None:
        found: PriceVersion | None = await self._session.scalar(
            select(PriceVersion).where(
                PriceVersion.base_model == base_model,
                PriceVersion.service_tier == service_tier,
                PriceVersion.effective_at == effective_at,
            )
        )
        return found

    async def add(self, price: PriceVersion) -> PriceVersion:
        self._session.add(price)
        await self._session.flush()
        return price


class BillingUsageRepository:
    """Reads of the usage table for billing (the usage domain owns its writes)."""

    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def has_usage_since(self, base_model: str, since: datetime, service_tier: str | None = None) -> bool:
        """Whether a request of `base_model` (and of `service_tier`, if given) that started at or after `since` is
        recorded."""
        conditions = [UsageRecord.base_model == base_model, UsageRecord.started_at >= since]
        if service_tier is not None:
            conditions.append(UsageRecord.service_tier == service_tier)
        return bool(await self._session.scalar(select(exists().where(*conditions))))

    async def slices(
        self, *, start: datetime, end: datetime, group_by: GroupBy, tenant_id: TenantId | None = None
    ) -> list[UsageSlice]:
        """Usage of requests started in [start, end), summed in the database by (group key, price version that
        rates the request). One pass over the usage rows of the range; what comes back is one row per group and
        version, however many requests there were.

        A version is in force from its `effective_at` (inclusive) to the next version's of the same base model and
        tier (exclusive): the window comes from `lead()` over those versions, so each usage row joins at most one
        version of its own tier (`own`), and, only when it found none, at most one of the default tier
        (`fallback`): the rule of rating.py's docstring."""
        versions = select(
            PriceVersion.id,
            PriceVersion.base_model,
            PriceVersion.service_tier,
            PriceVersion.input_per_mtok,
            PriceVersion.cached_input_per_mtok,
            PriceVersion.output_per_mtok,
            PriceVersion.reasoning_per_mtok,
            PriceVersion.effective_at.label("since"),
            func.lead(PriceVersion.effective_at)
            .over(partition_by=(PriceVersion.base_model, PriceVersion.service_tier), order_by=PriceVersion.effective_at)
            .label("until"),
        ).cte("price_windows")
        own, fallback = versions.alias("own_tier"), versions.alias("default_tier")

        def in_force(window: Any) -> Any:
            return and_(
                window.c.base_model == UsageRecord.base_model,
                UsageRecord.started_at >= window.c.since,
                or_(window.c.until.is_(None), UsageRecord.started_at < window.c.until),
            )

        keys = self._key_columns(group_by)
        # `fallback` joins only rows `own` did not: one of each pair is null, and coalesce takes the other.
        price_columns = tuple(
            func.coalesce(own.c[name], fallback.c[name])
            for name in ("id", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "reasoning_per_mtok")
        )
        query = (
            select(
                *keys,
                *price_columns,
                func.count(),
                func.coalesce(func.sum(UsageRecord.prompt_tokens - UsageRecord.cached_tokens), 0),
                func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
                func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
                func.coalesce(func.sum(UsageRecord.reasoning_tokens), 0),
            )
            .select_from(UsageRecord)
            .outerjoin(own, and_(in_force(own), own.c.service_tier == UsageRecord.service_tier))
            .outerjoin(
                fallback,
                and_(in_force(fallback), fallback.c.service_tier == DEFAULT_TIER, own.c.id.is_(None)),
            )
            .where(UsageRecord.started_at >= start, UsageRecord.started_at < end)
            .group_by(*keys, *price_columns)
        )
        if group_by is GroupBy.TENANT:
            query = query.outerjoin(Tenant, Tenant.id == UsageRecord.tenant_id)
        if tenant_id is not None:
            query = query.where(UsageRecord.tenant_id == tenant_id)
        width = len(keys)
        result: list[UsageSlice] = []
        for row in (await self._session.execute(query)).all():
            version_id, input_price, cached_price, output_price, reasoning_price = row[width : width + 5]
            terms = (
                None
                if version_id is None
                else PriceTerms(
                    input_per_mtok=input_price,
                    cached_input_per_mtok=cached_price,
                    output_per_mtok=output_price,
                    reasoning_per_mtok=reasoning_price,
                )
            )
            requests, uncached, cached, output, reasoning = (int(n) for n in row[width + 5 :])
            result.append(
                UsageSlice(
                    key=_key(row[:width]),
                    terms=terms,
                    requests=requests,
                    input_uncached_tokens=uncached,
                    input_cached_tokens=cached,
                    output_tokens=output,
                    reasoning_tokens=reasoning,
                )
            )
        return result

    def _key_columns(self, group_by: GroupBy) -> tuple[Any, ...]:
        """The grouped expressions, in the order of `group_by.key_names`."""
        if group_by is GroupBy.TENANT:
            return (Tenant.name, UsageRecord.tenant_id)
        if group_by is GroupBy.ENDPOINT:
            # Requests that named a base model have no endpoint; they group by (tenant, base model name).
            return (UsageRecord.tenant_id, UsageRecord.endpoint_id, UsageRecord.model)
        if group_by is GroupBy.MODEL:
            return (UsageRecord.base_model,)
        if group_by is GroupBy.SERVICE_TIER:
            return (UsageRecord.service_tier,)
        # The UTC calendar day the request started.
        if self._session.get_bind().dialect.name == "postgresql":
            # A literal, not a bound parameter: GROUP BY must repeat the selected expression exactly.
            return (cast(func.timezone(literal_column("'UTC'"), UsageRecord.started_at), Date),)
        return (func.date(UsageRecord.started_at),)  # SQLite stores UTC text, "YYYY-MM-DD HH:MM:SS.ffffff"


def _key(parts: Any) -> GroupKey:
    return tuple(None if part is None else part.isoformat() if isinstance(part, date) else str(part) for part in parts)
