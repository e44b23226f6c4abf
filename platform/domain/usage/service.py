"""Usage reads for a tenant. Stateless; never commits (writes go through `UsageRecorder`, which owns its sessions)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import Page
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

    async def report(
        self, tenant_id: TenantId, *, start: datetime, end: datetime, limit: int, after: str | None
    ) -> UsageReport:
        totals = await self._usage.totals(tenant_id, start=start, end=end)
        page = await self._usage.list_in_range(tenant_id, start=start, end=end, limit=limit, after=after)
        return UsageReport(start=start, end=end, totals=totals, page=page)
