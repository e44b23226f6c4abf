"""HTTP for a tenant's usage under /v1/usage."""

from __future__ import annotations

from litestar import Controller, get
from litestar.params import FromQuery

from loraplex.platform.dependencies import DbSession, Principal
from loraplex.platform.domain.usage.schemas import (
    UsageBillingOut,
    UsageGroupBy,
    UsageOut,
    UsageRecordOut,
    UsageTotalsOut,
    parse_instant,
)
from loraplex.platform.domain.usage.service import UsageService, resolve_range
from loraplex.platform.schemas import PageLimit


class UsageController(Controller):
    path = "/usage"
    tags = ["tenant: usage"]

    @get(
        "/",
        summary="Your usage: totals and cost over [start, end), and the requests in it, newest first",
        description="start and end: unix seconds or ISO 8601 (default: the last 24 hours; at most 92 days). "
        "`billing` is what the period costs, rated and rounded as the admin billing report does; "
        "group_by=endpoint|model|day|service_tier adds `billing.rows`.",
    )
    async def usage(
        self,
        principal: Principal,
        db: DbSession,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        limit: PageLimit = 20,
        after: FromQuery[str | None] = None,
        group_by: FromQuery[UsageGroupBy | None] = None,
    ) -> UsageOut:
        since, until = resolve_range(
            None if start is None else parse_instant(start, param="start"),
            None if end is None else parse_instant(end, param="end"),
        )
        report = await UsageService(db).report(
            principal.tenant_id,
            start=since,
            end=until,
            limit=limit,
            after=after,
            group_by=None if group_by is None else group_by.billing,
        )
        items = report.page.items
        return UsageOut(
            start=report.start,
            end=report.end,
            totals=UsageTotalsOut.of(report.totals),
            billing=UsageBillingOut.of(report.billing, group_by),
            data=[UsageRecordOut.of(r) for r in items],
            has_more=report.page.has_more,
            first_id=items[0].request_id if items else None,
            last_id=items[-1].request_id if items else None,
        )
