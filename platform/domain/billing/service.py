"""Billing logic: the price book's rules and rated reports. Stateless; never commits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.billing.models import PRICE_SCALE, PriceVersion
from loraplex.platform.domain.billing.rating import CURRENCY, GroupBy, Line, rate, round_report
from loraplex.platform.domain.billing.repository import BillingUsageRepository, PriceRepository
from loraplex.platform.errors import ApiError, conflict, invalid_request
from loraplex.platform.ids import TenantId
from loraplex.platform.service_tiers import ServiceTier

PRICE_QUANTUM = Decimal(1).scaleb(-PRICE_SCALE)
CACHED_INPUT_SHARE = Decimal("0.1")  # the cached-input price when none is given: a tenth of the input price


def default_cached_price(input_per_mtok: Decimal) -> Decimal:
    """A tenth of the input price, rounded half-even to the price book's 9 decimals."""
    return (input_per_mtok * CACHED_INPUT_SHARE).quantize(PRICE_QUANTUM, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True, slots=True)
class BillingReport:
    start: datetime
    end: datetime
    group_by: GroupBy
    currency: str
    lines: list[Line]  # rounded
    totals: Line  # rounded; `exact_totals` unrounded
    exact_totals: Line


class BillingService:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session
        self._prices = PriceRepository(session)
        self._usage = BillingUsageRepository(session)
        self._base_models = BaseModelRepository(session)

    async def set_price(
        self,
        base_model: str,
        *,
        input_per_mtok: Decimal,
        cached_input_per_mtok: Decimal | None,
        output_per_mtok: Decimal,
        effective_at: datetime | None,
        reasoning_per_mtok: Decimal | None = None,
        service_tier: ServiceTier = ServiceTier.DEFAULT,
        now: datetime | None = None,
    ) -> PriceVersion:
        """Add a version of `base_model`'s prices for `service_tier`, in force from `effective_at` (default: now).
        Without `reasoning_per_mtok`, reasoning tokens are priced as output (PriceVersion's default).

        The past is never rewritten: a version is refused (409 `would_rewrite_history`) when a recorded request it
        could rate started at or after its `effective_at`, since that request is already rated by the version
        before. A flex or priority version rates only requests of its tier; a default version also those of a tier
        without a version of its own, so for it every request of the base model counts. So a version may be dated
        back only over time in which it would rate nothing (a first price, typically); otherwise it takes effect now
        or later. One version per base model, tier and instant (409 otherwise)."""
        if await self._base_models.get_by_name(base_model) is None:
            raise invalid_request(
                f"Unknown 'base_model': no base model is named '{base_model}'.",
                param="base_model",
                code="model_not_found",
            )
        cached = default_cached_price(input_per_mtok) if cached_input_per_mtok is None else cached_input_per_mtok
        if cached > input_per_mtok:
            raise invalid_request(
                "'cached_input_per_mtok' must not exceed 'input_per_mtok'.", param="cached_input_per_mtok"
            )
        since = effective_at if effective_at is not None else (now or datetime.now(UTC))
        tier = service_tier.value
        rated_tier = None if service_tier is ServiceTier.DEFAULT else tier
        if await self._usage.has_usage_since(base_model, since, rated_tier):
            of_tier = "" if rated_tier is None else f" on the {tier} tier"
            raise ApiError(
                409,
                f"Requests of '{base_model}'{of_tier} started at or after {since.isoformat()} are already recorded "
                "and rated by the version then in force; a new version may take effect only after the latest of them.",
                code="would_rewrite_history",
                param="effective_at",
            )
        duplicate = conflict(
            f"'{base_model}' already has a {tier} tier price version effective at {since.isoformat()}.",
            param="effective_at",
        )
        if await self._prices.get_at(base_model, tier, since) is not None:
            raise duplicate
        version = PriceVersion(
            base_model=base_model,
            service_tier=tier,
            input_per_mtok=input_per_mtok,
            cached_input_per_mtok=cached,
            output_per_mtok=output_per_mtok,
            currency=CURRENCY,
            effective_at=since,
        )
        if reasoning_per_mtok is not None:
            version.reasoning_per_mtok = reasoning_per_mtok
        try:
            async with self._session.begin_nested():
                return await self._prices.add(version)
        except IntegrityError:  # the same instant, added concurrently
            raise duplicate from None

    async def prices(self, base_model: str | None = None) -> list[PriceVersion]:
        return await self._prices.list(base_model)

    async def report(
        self, *, start: datetime, end: datetime, group_by: GroupBy, tenant_id: TenantId | None = None
    ) -> BillingReport:
        """Requests started in [start, end), grouped, each rated by the price version in force when it started (of
        its service tier, else of the default tier: rating.py)."""
        slices = await self._usage.slices(start=start, end=end, group_by=group_by, tenant_id=tenant_id)
        rounded = round_report(rate(slices))
        return BillingReport(
            start=start,
            end=end,
            group_by=group_by,
            currency=CURRENCY,
            lines=rounded.lines,
            totals=rounded.totals,
            exact_totals=rounded.exact_totals,
        )
