"""The admin billing page (`GET /admin/billing`): one period's billing reports drawn as a self-contained HTML page.

Here lives the data side: the reports (`gather`), the period (`page_range`), and the building of the view model the
templates lay out (`page_view`; its shapes, `BillingPage` and its parts, are in page_view.py): every figure
formatted, every length computed. The markup, SVG and CSS live in templates/ (billing_page.html,
billing_charts.html, billing_page.css), rendered by Litestar's Jinja engine with autoescaping on, so every string a
tenant chose (tenant and endpoint names) is escaped wherever it lands without a call here. The controller answers a
`Template` response through the app's engine; `render` gives the same bytes through an engine made the same way
(`template_engine`), for tests.

Everything on the page is made on the server: inline CSS and inline SVG; no script, no font, no URL. The page goes
out with a Content-Security-Policy that lets nothing load (`PAGE_HEADERS`), so a slip in a template cannot make a
browser fetch from anywhere. The console shows the same report (billing_sections.html) in its own frame, under its
own CSP, which allows no inline style: so no element carries a `style` attribute, and the console links
billing_page.css as a file (`STYLESHEET`). Every figure shown is a rounded figure of a `BillingService` report,
formatted but never recomputed; only the geometry (bar lengths) is float. Why: docs/decisions/0013-billing-page.md.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from litestar.plugins.jinja import JinjaTemplateEngine
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.billing.page_view import (
    AxisLabel,
    Bar,
    BarChart,
    BarPlot,
    BarTick,
    BillingPage,
    Card,
    CostChart,
    CostPlot,
    DayBar,
    DaySlot,
    Frame,
    LegendItem,
    NoData,
    Segment,
    TenantRow,
    Tick,
)
from loraplex.platform.domain.billing.rating import MONEY_QUANTUM, GroupBy, Line
from loraplex.platform.domain.billing.service import BillingReport, BillingService
from loraplex.platform.domain.usage.service import resolve_range
from loraplex.platform.ids import TenantId
from loraplex.platform.wording import plural

DEFAULT_DAYS = 30  # without `start`: this many UTC calendar days, the one `end` falls in included
MAX_STACKED_TENANTS = 8  # the costliest tenants get a colour each in the cost chart; the rest share one
MAX_HIT_RATE_TENANTS = 20
MAX_ENDPOINTS = 10

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",  # money of named customers: not for shared caches
}
NO_USAGE = "No usage in this period."

TEMPLATES = Path(__file__).with_name("templates")
PAGE_TEMPLATE = "billing_page.html"
STYLESHEET = TEMPLATES / "billing_page.css"

# Tableau 10's first eight (distinct in print and for the common colour-vision deficiencies), then a grey for
# the tenants beyond them.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7")
OTHER_COLOUR = "#bab0ac"
OTHER_TENANTS = "other tenants"

# The cost chart's viewBox width, about its width on a laptop's screen so that text comes out near its CSS size. The
# bar charts are HTML rows, not a fixed SVG: their labels wrap, whole, at any width.
_WIDTH = 960


@dataclass(frozen=True, slots=True)
class BillingPageData:
    """The reports the page is drawn from, all of the same period."""

    start: datetime
    end: datetime
    by_tenant: BillingReport
    by_day: BillingReport
    by_endpoint: BillingReport
    # tenant id -> that tenant's report by day, for the costliest tenants (at most MAX_STACKED_TENANTS)
    tenant_days: dict[str, BillingReport]


def page_range(start: datetime | None, end: datetime | None, *, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the page: `end` defaults to now, `start` to the UTC midnight that makes DEFAULT_DAYS calendar
    days; then the report's own checks (400 if empty or longer than the report allows)."""
    end = end if end is not None else now
    if start is None:
        last_day = (end - timedelta(microseconds=1)).date()
        start = datetime.combine(last_day - timedelta(days=DEFAULT_DAYS - 1), time(), tzinfo=UTC)
    return resolve_range(start, end)


async def gather(session: AsyncSession, *, start: datetime, end: datetime) -> BillingPageData:
    """The page's reports. On Postgres they read one snapshot (REPEATABLE READ), so the charts agree with each other
    even while usage rows arrive; `session` must not have begun a transaction yet."""
    if session.get_bind().dialect.name == "postgresql":
        await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    service = BillingService(session)
    by_tenant = await service.report(start=start, end=end, group_by=GroupBy.TENANT)
    by_day = await service.report(start=start, end=end, group_by=GroupBy.DAY)
    by_endpoint = await service.report(start=start, end=end, group_by=GroupBy.ENDPOINT)
    tenant_days: dict[str, BillingReport] = {}
    for tenant_id in stacked_tenants(by_tenant):
        tenant_days[tenant_id] = await service.report(
            start=start, end=end, group_by=GroupBy.DAY, tenant_id=TenantId(uuid.UUID(tenant_id))
        )
    return BillingPageData(
        start=start, end=end, by_tenant=by_tenant, by_day=by_day, by_endpoint=by_endpoint, tenant_days=tenant_days
    )


def stacked_tenants(by_tenant: BillingReport) -> list[str]:
    """The ids of the tenants the cost chart draws apart: the MAX_STACKED_TENANTS costliest with a cost, costliest
    first (then most requests, then report order)."""
    return [_tenant_id(line) for line in _costliest(by_tenant.lines, MAX_STACKED_TENANTS)]


def template_engine() -> JinjaTemplateEngine:
    """A Litestar Jinja engine over templates/. Autoescaped: `{{ }}` escapes for text and double-quoted attributes
    (`<>&'"`), and nothing on the page is marked safe. A name the templates get wrong fails instead of rendering
    empty. Block tags take their line with them, so the templates can be indented without blank lines in the page.
    The app's TemplateConfig gets one and `render` another, so both give the same bytes."""
    environment = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return JinjaTemplateEngine.from_environment(environment)


_ENGINE = template_engine()


def page_view(data: BillingPageData, *, generated_at: datetime) -> BillingPage:
    """The view model of the page. Pure: the same data gives the same page."""
    empty = data.by_tenant.totals.requests == 0
    names = _tenant_names(data.by_tenant.lines)
    return BillingPage(
        period=f"{data.start:%Y-%m-%d %H:%M} to {data.end:%Y-%m-%d %H:%M} UTC",
        cards=_cards(data.by_tenant.totals),
        empty_message=NO_USAGE if empty else None,
        cost_per_day=_cost_per_day(data, names),
        hit_rates=_hit_rates(data.by_tenant.lines, names),
        endpoints=_endpoints(data.by_endpoint.lines, names),
        max_endpoints=MAX_ENDPOINTS,
        tenants=() if empty else _tenant_rows(data.by_tenant, names),
        currency=data.by_tenant.currency,
        generated=f"{generated_at:%Y-%m-%d %H:%M:%S}",
    )


def page_context(data: BillingPageData, *, generated_at: datetime) -> dict[str, BillingPage]:
    """The context PAGE_TEMPLATE is rendered with, by the controller's `Template` response and by `render`."""
    return {"page": page_view(data, generated_at=generated_at)}


def render(data: BillingPageData, *, generated_at: datetime) -> str:
    """The whole page, as the controller sends it. Pure: the same data gives the same bytes."""
    return _ENGINE.get_template(PAGE_TEMPLATE).render(page_context(data, generated_at=generated_at))


# --- pieces -------------------------------------------------------------------------------------------------------


def _cards(totals: Line) -> tuple[Card, ...]:
    tokens = totals.input_uncached_tokens + totals.input_cached_tokens + totals.output_tokens
    cards = [
        Card("requests", "Requests", f"{totals.requests:,}", ""),
        Card(
            "tokens",
            "Tokens",
            f"{tokens:,}",
            f"{totals.input_uncached_tokens:,} input, {totals.input_cached_tokens:,} cached input, "
            f"{totals.output_tokens:,} output ({totals.reasoning_tokens:,} reasoning)",
        ),
        Card("cost", "Cost", _usd(totals.cost_total), f"cache hit rate {_percent(totals.cache_hit_rate)}"),
        Card("cache-savings", "Cache savings", _usd(totals.cache_savings), "saved by prefix-cache hits"),
    ]
    if totals.unpriced_requests:
        cards.append(
            Card("unpriced", "Unpriced requests", f"{totals.unpriced_requests:,}", "no price in force: rated 0")
        )
    return tuple(cards)


def _cost_per_day(data: BillingPageData, names: dict[str, str]) -> CostChart:
    """Stacked bars: one per UTC day of the period, one segment per (tenant, day) with a cost, the costliest tenant
    at the bottom. Tenants beyond the MAX_STACKED_TENANTS costliest share one grey segment: the day's total less
    theirs (the only figure on the page that is a difference of report figures)."""
    days = _days(data.start, data.end)
    day_totals = {line.key[0]: line for line in data.by_day.lines}
    stacked = list(data.tenant_days)
    colours = {tenant_id: PALETTE[i % len(PALETTE)] for i, tenant_id in enumerate(stacked)}
    costs = {
        tenant_id: {line.key[0]: line.cost_total for line in report.lines if line.cost_total > 0}
        for tenant_id, report in data.tenant_days.items()
    }
    has_others = sum(1 for line in data.by_tenant.lines if line.cost_total > 0) > len(stacked)
    others: dict[str, Decimal] = {}
    if has_others:
        for day, line in day_totals.items():
            rest = line.cost_total - sum((costs[t].get(day, Decimal(0)) for t in stacked), Decimal(0))
            if day is not None and rest > 0:
                others[day] = rest
    # The tallest bar: a day's total, or its stacked segments where their own roundings add up to a little more.
    stacked_sums = (sum((c.get(day, Decimal(0)) for c in costs.values()), others.get(day, Decimal(0))) for day in days)
    top = max([*(line.cost_total for line in day_totals.values()), *stacked_sums], default=Decimal(0))
    title, desc = "Cost per day, stacked by tenant", f"Cost in USD of each UTC day from {days[0]} to {days[-1]}."
    left, right, top_pad, bottom = 84, 12, 14, 34
    height = 320
    plot_w, plot_h = _WIDTH - left - right, height - top_pad - bottom
    if top <= 0:
        message = NO_USAGE if data.by_tenant.totals.requests == 0 else "No priced usage."
        return CostChart(Frame("cost-per-day", _WIDTH, 120, title, desc), plot=None, no_data=_no_data(120, message))
    ticks = _ticks(top)
    scale = plot_h / float(ticks[-1])
    decimals = _decimals(ticks[1] - ticks[0])
    base_y = top_pad + plot_h
    gridlines = []
    for tick in ticks:
        y = base_y - float(tick) * scale
        gridlines.append(Tick(y=f"{y:.1f}", label_y=f"{y + 4:.1f}", label=f"${tick:,.{decimals}f}"))
    slot = plot_w / len(days)
    bar_w = max(slot * 0.72, 1.0)
    label_every = math.ceil(len(days) / 12)
    slots = []
    for i, day in enumerate(days):
        x = left + i * slot + (slot - bar_w) / 2
        total = day_totals.get(day)
        bar = None
        if total is not None:
            segments = []
            y = float(base_y)
            pieces = [(t, names[t], colours[t], costs[t].get(day)) for t in stacked]
            pieces.append(("other", OTHER_TENANTS, OTHER_COLOUR, others.get(day)))
            for tenant_id, name, colour, cost in pieces:
                if cost is None:
                    continue
                h = float(cost) * scale
                y -= h
                segments.append(
                    Segment(
                        tenant_id=tenant_id,
                        day=day,
                        cost=_money(cost),
                        x=f"{x:.2f}",
                        y=f"{y:.2f}",
                        width=f"{bar_w:.2f}",
                        height=f"{max(h, 0.5):.2f}",
                        fill=colour,
                        title=f"{name}, {day}: {_usd(cost)}",
                    )
                )
            summary = f"{day}: {_usd(total.cost_total)}, {plural(total.requests, 'request')}"
            bar = DayBar(day=day, title=summary, segments=tuple(segments))
        label = None
        if i % label_every == 0:
            shown = date.fromisoformat(day)
            label = AxisLabel(x=f"{x + bar_w / 2:.1f}", y=base_y + 18, text=f"{shown:%b} {shown.day}")
        slots.append(DaySlot(bar=bar, label=label))
    legend = [LegendItem(t, names[t], colours[t]) for t in stacked]
    if has_others:
        legend.append(LegendItem("other", OTHER_TENANTS, OTHER_COLOUR))
    plot = CostPlot(
        x1=left,
        x2=_WIDTH - right,
        tick_x=left - 8,
        base_y=base_y,
        ticks=tuple(gridlines),
        days=tuple(slots),
        legend=tuple(legend),
    )
    return CostChart(Frame("cost-per-day", _WIDTH, height, title, desc), plot=plot, no_data=None)


def _hit_rates(lines: Sequence[Line], names: dict[str, str]) -> BarChart:
    """Horizontal bars: each tenant's cached share of its prompt tokens, the costliest MAX_HIT_RATE_TENANTS."""
    shown = _costliest(lines, MAX_HIT_RATE_TENANTS, priced_only=False)
    rows = [
        (
            _tenant_id(line),
            names[_tenant_id(line)],
            float(line.cache_hit_rate),
            _percent(line.cache_hit_rate),
            f"{line.input_cached_tokens:,} of "
            + plural(line.input_uncached_tokens + line.input_cached_tokens, "prompt token"),
        )
        for line in shown
    ]
    return _bars(
        "cache-hit-rate",
        "Prefix-cache hit rate per tenant",
        "Share of each tenant's prompt tokens served from the prefix cache.",
        rows,
        maximum=1.0,
        colour="#59a14f",
        more=len(lines) - len(shown),
        axis=[(0.0, "0%"), (0.25, "25%"), (0.5, "50%"), (0.75, "75%"), (1.0, "100%")],
    )


def _endpoints(lines: Sequence[Line], names: dict[str, str]) -> BarChart:
    """Horizontal bars: the MAX_ENDPOINTS costliest (tenant, endpoint) lines of the report by endpoint."""
    ranked = sorted(lines, key=lambda line: (-line.cost_total, -line.requests))[:MAX_ENDPOINTS]
    top = max((line.cost_total for line in ranked), default=Decimal(0))
    rows = []
    for line in ranked:
        tenant_id, endpoint_id, model = line.key
        what = model or "?"
        if endpoint_id is None:
            what += " (base)"
        tenant = names.get(tenant_id or "", tenant_id or "?")
        rows.append(
            (
                endpoint_id or f"{tenant_id}/{model}",
                f"{what} · {tenant}",
                float(line.cost_total / top) if top > 0 else 0.0,
                _usd(line.cost_total),
                plural(line.requests, "request"),
            )
        )
    return _bars(
        "top-endpoints",
        f"Top {MAX_ENDPOINTS} endpoints by cost",
        "The endpoints (or base models called by name) that cost the most, with their tenant.",
        rows,
        maximum=1.0,
        colour="#4e79a7",
        more=0,
        axis=[],
    )


def _bars(
    chart: str,
    title: str,
    desc: str,
    rows: Sequence[tuple[str, str, float, str, str]],
    *,
    maximum: float,
    colour: str,
    more: int,
    axis: Sequence[tuple[float, str]],
) -> BarChart:
    """A horizontal bar chart; `rows` are (id, label, value in [0, maximum], value text, detail)."""
    if not rows:
        return BarChart(chart, title, desc, plot=None, no_data=NO_USAGE)
    bars = tuple(
        Bar(
            row_id=row_id,
            value=value_text,
            title=f"{label}: {value_text} ({detail})",
            label=label,
            length=f"{100 * min(max(value / maximum, 0.0), 1.0):.2f}",
        )
        for row_id, label, value, value_text, detail in rows
    )
    ticks = tuple(
        BarTick(f"{100 * fraction:g}", "start" if fraction <= 0 else "end" if fraction >= 1 else "middle", text)
        for fraction, text in axis
    )
    plot = BarPlot(colour=colour, bars=bars, axis=ticks, more=f"{more:,}" if more > 0 else None)
    return BarChart(chart, title, desc, plot=plot, no_data=None)


def _tenant_rows(report: BillingReport, names: dict[str, str]) -> tuple[TenantRow, ...]:
    """The tenants costliest first, then the totals."""
    return tuple(
        TenantRow(
            name="Total" if not line.key else names[_tenant_id(line)],
            requests=f"{line.requests:,}",
            input_tokens=f"{line.input_uncached_tokens:,}",
            cached_input_tokens=f"{line.input_cached_tokens:,}",
            output_tokens=f"{line.output_tokens:,}",
            reasoning_tokens=f"{line.reasoning_tokens:,}",
            cache_hit_rate=_percent(line.cache_hit_rate),
            cost=_usd(line.cost_total),
            cache_savings=_usd(line.cache_savings),
            total=not line.key,
        )
        for line in [*_costliest(report.lines, len(report.lines), priced_only=False), report.totals]
    )


# --- helpers ------------------------------------------------------------------------------------------------------


def _no_data(height: int, message: str) -> NoData:
    return NoData(x=f"{_WIDTH / 2}", y=f"{height / 2 + 5}", text=message)


def _tenant_id(line: Line) -> str:
    return line.key[1] or ""  # a line by tenant: (name, id); the id is never None (usage's tenant_id is NOT NULL)


def _costliest(lines: Sequence[Line], limit: int, *, priced_only: bool = True) -> list[Line]:
    """Up to `limit` of `lines`, costliest first (then most requests, then report order)."""
    kept = [line for line in lines if line.cost_total > 0 or not priced_only]
    return sorted(kept, key=lambda line: (-line.cost_total, -line.requests))[:limit]


def _tenant_names(lines: Sequence[Line]) -> dict[str, str]:
    """tenant id -> the name to show: the tenant's name, with the id's start added where two tenants share it."""
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for line in lines:
        seen[line.key[0] or ""] = seen.get(line.key[0] or "", 0) + 1
    for line in lines:
        tenant_id, name = _tenant_id(line), line.key[0]
        if name is None:
            names[tenant_id] = f"(deleted tenant {tenant_id[:8]})"
        else:
            names[tenant_id] = name if seen[name] == 1 else f"{name} ({tenant_id[:8]})"
    return names


def _days(start: datetime, end: datetime) -> list[str]:
    """The UTC dates (ISO) from `start`'s to that of the last instant before `end`."""
    first, last = start.astimezone(UTC).date(), (end.astimezone(UTC) - timedelta(microseconds=1)).date()
    return [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def _ticks(top: Decimal, count: int = 5) -> list[Decimal]:
    """0 and multiples of a 1-2-5 step, up to the first one at or above `top` (> 0), at most `count` steps."""
    base = Decimal(1).scaleb((top / count).adjusted())
    step = next(base * m for m in (1, 2, 5, 10) if base * m * count >= top)
    return [step * i for i in range(math.ceil(top / step) + 1)]


def _decimals(step: Decimal) -> int:
    exponent = step.normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _money(amount: Decimal) -> str:
    """As the report writes it: "1.500000"."""
    return f"{amount.quantize(MONEY_QUANTUM):f}"


def _usd(amount: Decimal) -> str:
    return f"${amount.quantize(MONEY_QUANTUM):,f}"


def _percent(rate: Decimal) -> str:
    """A report's 4-decimal rate as a percentage with 2 decimals: exact, no further rounding."""
    return f"{rate * 100:.2f}%"
