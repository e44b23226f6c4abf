"""The tenant's Usage page: what a period of whole UTC days cost, as the admin billing report rates it for this tenant
(by day and by endpoint), with summary cards, a chart per day for requests, tokens, cached tokens and cost, and the
per-day bill as CSV.

The period is a start and an end date, both included (default: the last DEFAULT_DAYS UTC days, today included), made
an instant range by the billing page's `page_range`, so its defaults and limits are the billing page's. Every figure
is a figure of `BillingService.report` with this tenant's id, formatted but never recomputed; only the bar lengths
are derived (charts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from litestar import Controller, Response, get
from litestar.params import FromQuery
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.charts import BarChart, Series, bar_chart, stacked_chart
from loraplex.platform.console.pages import page, usd
from loraplex.platform.console.security import PAGE_HEADERS
from loraplex.platform.dependencies import DbSession
from loraplex.platform.domain.billing.controllers import CSV_MEDIA_TYPE
from loraplex.platform.domain.billing.page import NO_USAGE, page_range
from loraplex.platform.domain.billing.rating import GroupBy, Line
from loraplex.platform.domain.billing.schemas import report_csv
from loraplex.platform.domain.billing.service import BillingReport, BillingService
from loraplex.platform.errors import ApiError, invalid_request
from loraplex.platform.wording import plural

TITLE = "Usage"
PATH = "/console/usage"

TOKEN_SERIES = (
    Series("input", "Input"),
    Series("cached", "Cached input"),
    Series("output", "Output"),
)


@dataclass(frozen=True, slots=True)
class Period:
    """[start, end) as instants, and the dates the form shows for it (both included)."""

    start: datetime
    end: datetime

    @property
    def first_day(self) -> str:
        return self.start.date().isoformat()

    @property
    def last_day(self) -> str:
        return (self.end - timedelta(microseconds=1)).date().isoformat()

    @property
    def query(self) -> str:
        return f"start={self.first_day}&end={self.last_day}"


@dataclass(frozen=True, slots=True)
class SummaryCard:
    name: str  # its data-total
    label: str
    value: str
    note: str


@dataclass(frozen=True, slots=True)
class BillRow:
    """One line of a bill table (a day, an endpoint, or the totals), every figure formatted."""

    label: str
    requests: str
    input_tokens: str
    cached_tokens: str
    output_tokens: str  # reasoning tokens included
    reasoning_tokens: str
    cache_hit_rate: str
    cost: str
    total: bool = False


@dataclass(frozen=True, slots=True)
class UsageView:
    cards: tuple[SummaryCard, ...]
    charts: tuple[BarChart, ...]
    days: tuple[BillRow, ...]  # the days with usage, then the totals
    endpoints: tuple[BillRow, ...]  # costliest first, then the totals


def period(start: str | None, end: str | None, *, now: datetime) -> Period:
    """The period of the form's dates (blank: the default), checked as the billing page checks its own (400)."""
    first, last = _date(start, "start"), _date(end, "end")
    try:
        until = datetime.combine((last or now.date()) + timedelta(days=1), time(), tzinfo=UTC)
    except OverflowError:
        raise invalid_request("The end date is too far in the future.", param="end") from None
    since = None if first is None else datetime.combine(first, time(), tzinfo=UTC)
    return Period(*page_range(since, until, now=now))


def _date(text: str | None, param: str) -> date | None:
    if text is None or not text.strip():
        return None
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise invalid_request(f"The {param} date is not a date: give it as YYYY-MM-DD.", param=param) from None


async def _reports(db: AsyncSession, caller: ConsoleCaller, when: Period) -> tuple[BillingReport, BillingReport]:
    """The tenant's bill by day and by endpoint, read from one snapshot on Postgres so that the two agree even while
    usage rows arrive (as the billing page reads its reports)."""
    if db.get_bind().dialect.name == "postgresql":
        await db.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    service = BillingService(db)
    tenant_id = caller.principal.tenant_id
    by_day = await service.report(start=when.start, end=when.end, group_by=GroupBy.DAY, tenant_id=tenant_id)
    by_endpoint = await service.report(start=when.start, end=when.end, group_by=GroupBy.ENDPOINT, tenant_id=tenant_id)
    return by_day, by_endpoint


def usage_view(by_day: BillingReport, by_endpoint: BillingReport) -> UsageView | None:
    """The page's figures; None for a period without usage."""
    totals = by_day.totals
    if totals.requests == 0:
        return None
    days = [(line.key[0] or "", line) for line in by_day.lines]
    charts = (
        bar_chart(
            "requests", "Requests per day", [(d, line.requests, plural(line.requests, "request")) for d, line in days]
        ),
        stacked_chart(
            "tokens",
            "Tokens per day",
            TOKEN_SERIES,
            [
                (
                    d,
                    (line.input_uncached_tokens, line.input_cached_tokens, line.output_tokens),
                    plural(_tokens(line), "token"),
                )
                for d, line in days
            ],
        ),
        bar_chart(
            "cached-tokens",
            "Cached input tokens per day",
            [(d, line.input_cached_tokens, plural(line.input_cached_tokens, "token")) for d, line in days],
        ),
        bar_chart("cost", "Cost per day", [(d, float(line.cost_total), usd(line.cost_total)) for d, line in days]),
    )
    endpoints = sorted(
        by_endpoint.lines,
        key=lambda line: (-line.cost_total, -line.requests, tuple(part or "" for part in line.key)),
    )
    return UsageView(
        cards=_cards(totals, len(days)),
        charts=charts,
        days=(*(_row(d, line) for d, line in days), _row("Total", totals, total=True)),
        endpoints=(
            *(_row(_endpoint_label(line), line) for line in endpoints),
            _row("Total", by_endpoint.totals, total=True),
        ),
    )


def _cards(totals: Line, num_days: int) -> tuple[SummaryCard, ...]:
    note = f"on {plural(num_days, 'day')}"
    if totals.unpriced_requests:
        note += f"; {plural(totals.unpriced_requests, 'request')} without a price, rated $0"
    return (
        SummaryCard("requests", "Requests", f"{totals.requests:,}", note),
        SummaryCard(
            "tokens",
            "Tokens",
            f"{_tokens(totals):,}",
            f"{totals.input_uncached_tokens:,} input, {totals.input_cached_tokens:,} cached input, "
            f"{totals.output_tokens:,} output ({totals.reasoning_tokens:,} reasoning)",
        ),
        SummaryCard("cost", "Cost", usd(totals.cost_total), "each request at the price in force when it started"),
        SummaryCard("cache-savings", "Cache savings", usd(totals.cache_savings), "saved by prefix-cache hits"),
        SummaryCard(
            "cache-hit-rate",
            "Cache hit rate",
            _percent(totals.cache_hit_rate),
            f"{totals.input_cached_tokens:,} of {totals.input_uncached_tokens + totals.input_cached_tokens:,} "
            "prompt tokens",
        ),
    )


def _row(label: str, line: Line, *, total: bool = False) -> BillRow:
    return BillRow(
        label=label,
        requests=f"{line.requests:,}",
        input_tokens=f"{line.input_uncached_tokens:,}",
        cached_tokens=f"{line.input_cached_tokens:,}",
        output_tokens=f"{line.output_tokens:,}",
        reasoning_tokens=f"{line.reasoning_tokens:,}",
        cache_hit_rate=_percent(line.cache_hit_rate),
        cost=usd(line.cost_total),
        total=total,
    )


def _endpoint_label(line: Line) -> str:
    """What the requests named: an endpoint, or a base model by name (the report's key: tenant, endpoint, model)."""
    _, endpoint_id, model = line.key
    if endpoint_id is None:
        return f"{model} (base model)"
    return model or ""


def _tokens(line: Line) -> int:
    return line.input_uncached_tokens + line.input_cached_tokens + line.output_tokens


def _percent(rate: Decimal) -> str:
    """A report's 4-decimal rate as a percentage with 2 decimals: exact, no further rounding."""
    return f"{rate * 100:.2f}%"


class UsagePages(Controller):
    path = "/"

    @get("/usage")
    async def index(
        self,
        caller: Caller,
        db: DbSession,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
    ) -> Template:
        try:
            when = period(start, end, now=datetime.now(UTC))
        except ApiError as exc:
            return page(
                "usage.html",
                caller,
                title=TITLE,
                status_code=exc.status_code,
                error=exc.message,
                start=start or "",
                end=end or "",
                period=None,
                view=None,
                no_usage=NO_USAGE,
            )
        by_day, by_endpoint = await _reports(db, caller, when)
        return page(
            "usage.html",
            caller,
            title=TITLE,
            error=None,
            start=when.first_day,
            end=when.last_day,
            period=when,
            view=usage_view(by_day, by_endpoint),
            no_usage=NO_USAGE,
        )

    @get("/usage.csv", media_type="text/csv")
    async def csv(
        self,
        caller: Caller,
        db: DbSession,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
    ) -> Response[str]:
        """The per-day bill of the period, as the admin report's CSV (a bad period answers the error page)."""
        when = period(start, end, now=datetime.now(UTC))
        report = await BillingService(db).report(
            start=when.start, end=when.end, group_by=GroupBy.DAY, tenant_id=caller.principal.tenant_id
        )
        name = f"usage-{when.first_day}-to-{when.last_day}.csv"
        return Response(
            report_csv(report),
            media_type=CSV_MEDIA_TYPE,
            headers={**PAGE_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'},
        )
