"""Usage reads for a tenant. Stateless; never commits (writes go through `UsageRecorder`, which owns its sessions).

A tenant's usage carries its bill: the billing report (`BillingService.report`) restricted to the tenant, so the
numbers, the rating and the rounding (docs/decisions/0011-billing-rounding.md) are the admin report's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page
from loraplex.platform.domain.billing.rating import GroupBy
from loraplex.platform.domain.billing.service import BillingReport, BillingService
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.domain.usage.repository import UsageRepository, UsageTotals
from loraplex.platform.errors import invalid_request
from loraplex.platform.ids import TenantId

DEFAULT_RANGE = timedelta(hours=24)
MAX_RANGE = timedelta(days=92)  # a quarter: enough for any billing period, small enough to sum quickly


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: datetime
    end: datetime
    totals: UsageTotals
    page: Page[UsageRecord]
    billing: BillingReport  # the tenant's requests of [start, end), rated; lines by the `group_by` asked, or tenant


def resolve_range(
    start: datetime | None, end: datetime | None, *, now: datetime | None = None
) -> tuple[datetime, datetime]:
    """[start, end) with the defaults filled in (end: now; start: a day before end); 400 if empty or too long."""
    end = end if end is not None else (now or datetime.now(UTC))
    start = start if start is not None else end - DEFAULT_RANGE
    if start >= end:
        raise invalid_request("'start' must be before 'end'.", param="start")
    if end - start > MAX_RANGE:
        raise invalid_request(f"The range from 'start' to 'end' may span at most {MAX_RANGE.days} days.", param="end")
    return start, end


class UsageService:
    def __init__(self, session: AsyncSession) -> None:
        self._usage = UsageRepository(session)
        self._billing = BillingService(session)

    async def report(
        self,
        tenant_id: TenantId,
        *,
        start: datetime,
        end: datetime,
        limit: int,
        after: str | None,
        group_by: GroupBy | None = None,
    ) -> UsageReport:
        """The tenant's usage of [start, end): totals, one page of requests, and the bill.

        The bill is `BillingService.report` with this tenant's id, so its totals are, string for string, those of
        the admin report filtered to the tenant (`/admin/billing/report?tenant_id=`), and its lines (by
        `group_by`) that report's lines. They are rounded over the tenant's own requests: the tenant's line in an
        unfiltered admin report, where the rounding is spread over every tenant's lines, may differ by a
        micro-dollar in a cost part (each is its exact value rounded down or up in both). A tenant's bill must not
        move with other tenants' usage, so this view never rounds across them; where no rounding is needed the two
        agree exactly."""
        totals = await self._usage.totals(tenant_id, start=start, end=end)
        page = await self._usage.list_in_range(tenant_id, start=start, end=end, limit=limit, after=after)
        # Totals do not depend on the grouping (rounded once, from the exact sum): one query gives both.
        billing = await self._billing.report(
            start=start, end=end, group_by=group_by or GroupBy.TENANT, tenant_id=tenant_id
        )
        return UsageReport(start=start, end=end, totals=totals, page=page, billing=billing)
