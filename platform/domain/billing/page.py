"""The admin billing page (`GET /admin/billing`): one period's billing reports drawn as a self-contained HTML page.

Everything on the page is made here, on the server: inline CSS and inline SVG; no script, no font, no URL. The
page goes out with a Content-Security-Policy that lets nothing load (`PAGE_HEADERS`), so a slip here cannot make a
browser fetch from anywhere. Every figure shown is a rounded figure of a `BillingService` report, formatted but
never recomputed; only the geometry (bar lengths) is float. Every string a tenant chose (tenant and endpoint names)
goes through `html.escape`. Why: docs/decisions/0013-billing-page.md.
"""

from __future__ import annotations

import html
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.billing.rating import MONEY_QUANTUM, GroupBy, Line
from loraplex.platform.domain.billing.service import BillingReport, BillingService
from loraplex.platform.domain.usage.service import resolve_range
from loraplex.platform.ids import TenantId

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

# Tableau 10's first eight (distinct in print and for the common colour-vision deficiencies), then a grey for
# the tenants beyond them.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7")
OTHER_COLOUR = "#bab0ac"
OTHER_TENANTS = "other tenants"

# The charts' viewBox widths, about their width on a laptop's screen so that text comes out near its CSS size:
# the cost chart spans the column, the bar charts half of it.
_WIDTH = 960
_HALF_WIDTH = 540
_LABEL_CHARS = 28  # SVG text does not wrap: longer names are cut, the whole name is in the <title>


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


def render(data: BillingPageData, *, generated_at: datetime) -> str:
    """The whole page. Pure: the same data gives the same bytes."""
    empty = data.by_tenant.totals.requests == 0
    names = _tenant_names(data.by_tenant.lines)
    period = f"{data.start:%Y-%m-%d %H:%M} to {data.end:%Y-%m-%d %H:%M} UTC"
    body = [
        "<header><h1>Billing</h1>",
        f'<p class="period" data-period>Requests started from {_text(period)}. '
        "Query <code>?start=&amp;end=</code> (unix seconds or ISO 8601) for another period.</p></header>",
        _summary(data.by_tenant.totals),
    ]
    if empty:
        body.append(f'<p class="empty" data-empty>{NO_USAGE}</p>')
    body += [
        _section("Cost per day, by tenant", _cost_per_day(data, names)),
        '<div class="pair">',
        _section("Prefix-cache hit rate, by tenant", _hit_rates(data.by_tenant.lines, names)),
        _section(f"Top {MAX_ENDPOINTS} endpoints, by cost", _endpoints(data.by_endpoint.lines, names)),
        "</div>",
    ]
    if not empty:
        body.append(_section("Tenants", _tenant_table(data.by_tenant, names)))
    body.append(
        "<footer>Figures are the billing report's (<code>/admin/billing/report</code>), in "
        f"{_text(data.by_tenant.currency)}, rounded to micro-dollars once per line. "
        f"Generated {generated_at:%Y-%m-%d %H:%M:%S} UTC.</footer>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'  # or the browser asks the server for /favicon.ico
        f"<title>Billing · loraplex</title><style>{_CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


# --- pieces -------------------------------------------------------------------------------------------------------


def _summary(totals: Line) -> str:
    tokens = totals.input_uncached_tokens + totals.input_cached_tokens + totals.output_tokens
    cards = [
        ("requests", "Requests", f"{totals.requests:,}", ""),
        (
            "tokens",
            "Tokens",
            f"{tokens:,}",
            f"{totals.input_uncached_tokens:,} input, {totals.input_cached_tokens:,} cached input, "
            f"{totals.output_tokens:,} output",
        ),
        ("cost", "Cost", _usd(totals.cost_total), f"cache hit rate {_percent(totals.cache_hit_rate)}"),
        ("cache-savings", "Cache savings", _usd(totals.cache_savings), "saved by prefix-cache hits"),
    ]
    if totals.unpriced_requests:
        cards.append(("unpriced", "Unpriced requests", f"{totals.unpriced_requests:,}", "no price in force: rated 0"))
    items = "".join(
        f'<div class="card" data-total="{name}"><div class="label">{label}</div>'
        f'<div class="value">{_text(value)}</div><div class="note">{_text(note)}</div></div>'
        for name, label, value, note in cards
    )
    return f'<section class="summary" aria-label="Totals">{items}</section>'


def _cost_per_day(data: BillingPageData, names: dict[str, str]) -> str:
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
        return _svg_open("cost-per-day", 120, title, desc) + _no_data(120, message) + "</svg>"
    parts = [_svg_open("cost-per-day", height, title, desc)]
    ticks = _ticks(top)
    scale = plot_h / float(ticks[-1])
    decimals = _decimals(ticks[1] - ticks[0])
    base_y = top_pad + plot_h
    for tick in ticks:
        y = base_y - float(tick) * scale
        parts.append(f'<line class="grid" x1="{left}" x2="{_WIDTH - right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">${tick:,.{decimals}f}</text>'
        )
    slot = plot_w / len(days)
    bar_w = max(slot * 0.72, 1.0)
    label_every = math.ceil(len(days) / 12)
    for i, day in enumerate(days):
        x = left + i * slot + (slot - bar_w) / 2
        total = day_totals.get(day)
        if total is not None:
            summary = f"{day}: {_usd(total.cost_total)}, {total.requests:,} requests"
            parts.append(f'<g class="day" data-day="{day}"><title>{_text(summary)}</title>')
            y = base_y
            segments = [(t, names[t], colours[t], costs[t].get(day)) for t in stacked]
            segments.append(("other", OTHER_TENANTS, OTHER_COLOUR, others.get(day)))
            for tenant_id, name, colour, cost in segments:
                if cost is None:
                    continue
                h = float(cost) * scale
                y -= h
                parts.append(
                    f'<rect class="segment" data-tenant="{_attr(tenant_id)}" data-day="{day}"'
                    f' data-cost="{_money(cost)}" x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}"'
                    f' height="{max(h, 0.5):.2f}" fill="{colour}">'
                    f"<title>{_text(name)}, {day}: {_usd(cost)}</title></rect>"
                )
            parts.append("</g>")
        if i % label_every == 0:
            shown = date.fromisoformat(day)
            parts.append(
                f'<text class="tick" x="{x + bar_w / 2:.1f}" y="{base_y + 18}" text-anchor="middle">'
                f"{shown:%b} {shown.day}</text>"
            )
    parts.append(f'<line class="axis" x1="{left}" x2="{_WIDTH - right}" y1="{base_y}" y2="{base_y}"/></svg>')
    legend = [(t, names[t], colours[t]) for t in stacked]
    if has_others:
        legend.append(("other", OTHER_TENANTS, OTHER_COLOUR))
    items = "".join(
        f'<li data-tenant="{_attr(tenant_id)}"><span class="swatch" style="background:{colour}"></span>'
        f"{_text(name)}</li>"
        for tenant_id, name, colour in legend
    )
    parts.append(f'<ul class="legend" data-legend="cost-per-day">{items}</ul>')
    return "".join(parts)


def _hit_rates(lines: Sequence[Line], names: dict[str, str]) -> str:
    """Horizontal bars: each tenant's cached share of its prompt tokens, the costliest MAX_HIT_RATE_TENANTS."""
    shown = _costliest(lines, MAX_HIT_RATE_TENANTS, priced_only=False)
    rows = [
        (
            _tenant_id(line),
            names[_tenant_id(line)],
            float(line.cache_hit_rate),
            _percent(line.cache_hit_rate),
            f"{line.input_cached_tokens:,} of {line.input_uncached_tokens + line.input_cached_tokens:,} prompt tokens",
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


def _endpoints(lines: Sequence[Line], names: dict[str, str]) -> str:
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
                f"{line.requests:,} requests",
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
) -> str:
    """A horizontal bar chart; `rows` are (id, label, value in [0, maximum], value text, detail)."""
    width, row_h, label_w, value_w, top_pad = _HALF_WIDTH, 28, 196, 92, 6
    bar_x, bar_w = label_w + 8, width - label_w - 8 - value_w
    height = top_pad + len(rows) * row_h + (22 if axis else 6) if rows else 120
    parts = [_svg_open(chart, height, title, desc, width=width)]
    if not rows:
        parts.append(_no_data(height, NO_USAGE, width=width))
        parts.append("</svg>")
        return "".join(parts)
    for i, (row_id, label, value, value_text, detail) in enumerate(rows):
        y = top_pad + i * row_h
        length = bar_w * min(max(value / maximum, 0.0), 1.0)
        parts.append(
            f'<g class="bar" data-id="{_attr(row_id)}" data-value="{_attr(value_text)}">'
            f"<title>{_text(label)}: {_text(value_text)} ({_text(detail)})</title>"
            f'<text class="label" x="{label_w}" y="{y + 18}" text-anchor="end">{_text(_cut(label))}</text>'
            f'<rect class="track" x="{bar_x}" y="{y + 5}" width="{bar_w}" height="{row_h - 10}" rx="2"/>'
            f'<rect x="{bar_x}" y="{y + 5}" width="{length:.2f}" height="{row_h - 10}" rx="2" fill="{colour}"/>'
            f'<text class="value" x="{bar_x + bar_w + 6}" y="{y + 18}">{_text(value_text)}</text></g>'
        )
    base_y = top_pad + len(rows) * row_h
    for fraction, text in axis:
        x = bar_x + bar_w * fraction
        parts.append(f'<text class="tick" x="{x:.1f}" y="{base_y + 14}" text-anchor="middle">{text}</text>')
    parts.append("</svg>")
    if more > 0:
        parts.append(f'<p class="more">and {more:,} more (see the table)</p>')
    return "".join(parts)


def _tenant_table(report: BillingReport, names: dict[str, str]) -> str:
    head = (
        "<tr><th>Tenant</th><th>Requests</th><th>Input tokens</th><th>Cached input tokens</th><th>Output tokens</th>"
        "<th>Cache hit rate</th><th>Cost</th><th>Cache savings</th></tr>"
    )
    rows = []
    for line in [*_costliest(report.lines, len(report.lines), priced_only=False), report.totals]:
        is_total = not line.key
        name = "Total" if is_total else names[_tenant_id(line)]
        rows.append(
            f"<tr{' class=total' if is_total else ''}><td>{_text(name)}</td><td>{line.requests:,}</td>"
            f"<td>{line.input_uncached_tokens:,}</td><td>{line.input_cached_tokens:,}</td>"
            f"<td>{line.output_tokens:,}</td><td>{_percent(line.cache_hit_rate)}</td>"
            f"<td>{_usd(line.cost_total)}</td><td>{_usd(line.cache_savings)}</td></tr>"
        )
    return f'<table data-table="tenants"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


# --- helpers ------------------------------------------------------------------------------------------------------


def _section(heading: str, content: str) -> str:
    return f'<section class="chart"><h2>{_text(heading)}</h2>{content}</section>'


def _svg_open(chart: str, height: int, title: str, desc: str, *, width: int = _WIDTH) -> str:
    return (
        f'<svg data-chart="{chart}" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-labelledby="{chart}-title {chart}-desc" preserveAspectRatio="xMinYMin meet">'
        f'<title id="{chart}-title">{_text(title)}</title><desc id="{chart}-desc">{_text(desc)}</desc>'
    )


def _no_data(height: int, message: str, *, width: int = _WIDTH) -> str:
    return f'<text class="nodata" x="{width / 2}" y="{height / 2 + 5}" text-anchor="middle">{_text(message)}</text>'


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


def _cut(label: str) -> str:
    return label if len(label) <= _LABEL_CHARS else label[: _LABEL_CHARS - 1] + "…"


def _text(value: str) -> str:
    return html.escape(value, quote=True)


_attr = _text  # one function for both, quote=True: safe in text and in double-quoted attributes


_CSS = """
:root { color-scheme: light; --ink: #1f2933; --muted: #616e7c; --line: #e4e7eb; --panel: #ffffff; }
* { box-sizing: border-box; }
body { margin: 0; background: #f5f7fa; color: var(--ink);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", "Liberation Sans", sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 40px; }
header h1 { margin: 0 0 4px; font-size: 24px; }
.period { margin: 0 0 18px; color: var(--muted); }
code { font-family: "DejaVu Sans Mono", monospace; font-size: 12px; background: #eef1f4; padding: 1px 4px;
  border-radius: 3px; }
.summary { display: grid; grid-template-columns: repeat(auto-fit, minmax(200px, 1fr)); gap: 14px;
  margin-bottom: 18px; }
.card, .chart { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; }
.card { padding: 14px 16px; }
.card .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .05em; }
.card .value { font-size: 22px; font-weight: 600; margin: 2px 0; font-variant-numeric: tabular-nums; }
.card .note { color: var(--muted); font-size: 12px; }
.empty { background: #fff8e1; border: 1px solid #f3d98b; border-radius: 8px; padding: 10px 14px; }
.chart { padding: 14px 18px 16px; margin-bottom: 18px; overflow-x: auto; }
.chart h2 { font-size: 15px; margin: 0 0 8px; }
.pair { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 0 18px; }
svg { display: block; font-size: 13px; }
svg .tick { fill: var(--muted); font-size: 12px; }
svg .label { fill: var(--ink); }
svg .value { fill: var(--ink); font-variant-numeric: tabular-nums; }
svg .nodata { fill: var(--muted); font-size: 16px; }
svg .grid { stroke: var(--line); }
svg .axis { stroke: #9aa5b1; }
svg .track { fill: #f0f2f5; }
svg .segment:hover, svg .bar:hover rect:not(.track) { opacity: .8; }
.legend { list-style: none; display: flex; flex-wrap: wrap; gap: 6px 18px; padding: 0; margin: 10px 0 0 84px; }
.legend li { display: flex; align-items: center; gap: 6px; }
.swatch { width: 12px; height: 12px; border-radius: 2px; display: inline-block; }
.more { color: var(--muted); margin: 6px 0 0; }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; white-space: normal; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
tr.total td { font-weight: 600; border-bottom: none; }
footer { color: var(--muted); font-size: 12px; }
"""
