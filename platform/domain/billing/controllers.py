"""HTTP for billing under /admin: the price book (/admin/prices), the report (/admin/billing/report) and the page
with charts (/admin/billing)."""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime

from litestar import Controller, MediaType, Response, get, put
from litestar.params import FromQuery, JSONBody
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.dependencies import DbSession
from loraplex.platform.domain.billing.page import PAGE_HEADERS, PAGE_TEMPLATE, gather, page_context, page_range
from loraplex.platform.domain.billing.rating import GroupBy
from loraplex.platform.domain.billing.schemas import BillingReportOut, PriceList, PriceOut, PriceSet, report_csv
from loraplex.platform.domain.billing.service import BillingReport, BillingService
from loraplex.platform.domain.usage.schemas import parse_instant
from loraplex.platform.domain.usage.service import resolve_range
from loraplex.platform.ids import TenantId

CSV_MEDIA_TYPE = "text/csv; charset=utf-8"


class ReportFormat(enum.StrEnum):
    JSON = "json"
    CSV = "csv"


async def set_price(db: AsyncSession, data: PriceSet) -> PriceOut:
    """Add and commit a price version (the API's and the console's way); the version as the price book lists it."""
    service = BillingService(db)
    now = datetime.now(UTC)
    added = await service.set_price(
        data.base_model,
        input_per_mtok=data.input_per_mtok,
        cached_input_per_mtok=data.cached_input_per_mtok,
        output_per_mtok=data.output_per_mtok,
        reasoning_per_mtok=data.reasoning_per_mtok,
        effective_at=data.effective_at,
        service_tier=data.service_tier,
        now=now,
    )
    history = PriceOut.history(await service.prices(data.base_model), now)
    await db.commit()
    return next(version for version in history if version.id == str(added.id))


def csv_headers(report: BillingReport) -> dict[str, str]:
    """The headers of the report as a CSV download (`report_csv`, CSV_MEDIA_TYPE), named after its grouping and period:
    the API's and the console's."""
    name = f"billing-{report.group_by.value}-{report.start:%Y%m%dT%H%M%SZ}-{report.end:%Y%m%dT%H%M%SZ}.csv"
    return {"Content-Disposition": f'attachment; filename="{name}"'}


class AdminPriceController(Controller):
    path = "/prices"
    tags = ["admin: billing"]

    @get(
        "/",
        summary="The price book: every version per base model and service tier, with the one in force now marked "
        "current",
    )
    async def list(self, db: DbSession, base_model: FromQuery[str | None] = None) -> PriceList:
        rows = await BillingService(db).prices(base_model)
        return PriceList(data=PriceOut.history(rows, datetime.now(UTC)))

    @put(
        "/",
        status_code=201,
        summary="Add a version of a base model's prices (USD per million tokens) for a service tier, in force from "
        "effective_at",
    )
    async def set(self, data: JSONBody[PriceSet], db: DbSession) -> PriceOut:
        return await set_price(db, data)


class AdminBillingController(Controller):
    path = "/billing"
    tags = ["admin: billing"]

    @get(
        "/",
        media_type=MediaType.HTML,
        summary="An HTML page with charts of a period: cost per day by tenant, cache hit rates, top endpoints",
        description="start and end as in the report (default: the last 30 UTC days, today included; at most 92 "
        "days). Self-contained: inline CSS and SVG, no script, and a Content-Security-Policy that loads nothing.",
    )
    async def page(
        self, db: DbSession, start: FromQuery[str | None] = None, end: FromQuery[str | None] = None
    ) -> Template:
        now = datetime.now(UTC)
        since, until = page_range(
            None if start is None else parse_instant(start, param="start"),
            None if end is None else parse_instant(end, param="end"),
            now=now,
        )
        data = await gather(db, start=since, end=until)
        # Rendered by the app's engine (page.template_engine, in app.py's TemplateConfig), as page.render renders it.
        return Template(
            PAGE_TEMPLATE,
            context=page_context(data, generated_at=now),
            media_type=MediaType.HTML,
            headers=PAGE_HEADERS,
        )

    @get(
        "/report",
        summary="Usage and cost of requests started in [start, end), by tenant, endpoint, base model, UTC day or "
        "service tier",
        description="start and end: unix seconds or ISO 8601 (default: the last 24 hours; at most 92 days). "
        "format=csv answers a header row, one row per group and a totals row.",
    )
    async def report(
        self,
        db: DbSession,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        group_by: FromQuery[GroupBy] = GroupBy.TENANT,
        format: FromQuery[ReportFormat] = ReportFormat.JSON,
        tenant_id: FromQuery[uuid.UUID | None] = None,
    ) -> Response[BillingReportOut | str]:
        since, until = resolve_range(
            None if start is None else parse_instant(start, param="start"),
            None if end is None else parse_instant(end, param="end"),
        )
        report = await BillingService(db).report(
            start=since, end=until, group_by=group_by, tenant_id=None if tenant_id is None else TenantId(tenant_id)
        )
        if format is ReportFormat.CSV:
            return Response(report_csv(report), media_type=CSV_MEDIA_TYPE, headers=csv_headers(report))
        return Response(BillingReportOut.of(report))
