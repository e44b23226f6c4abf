"""The billing page's renderer (billing/page.py) on reports made in memory by the same rating and rounding the
service uses: escaping, self-containment, the charts' structure and that figures are the reports' own."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest

from loraplex.platform.domain.billing.page import (
    MAX_ENDPOINTS,
    MAX_STACKED_TENANTS,
    NO_USAGE,
    OTHER_TENANTS,
    BillingPageData,
    page_range,
    render,
    stacked_tenants,
)
from loraplex.platform.domain.billing.rating import GroupBy, GroupKey, PriceTerms, UsageSlice, rate, round_report
from loraplex.platform.domain.billing.service import BillingReport
from loraplex.platform.domain.usage.service import MAX_RANGE
from loraplex.platform.errors import ApiError

pytestmark = pytest.mark.unit

START = datetime(2026, 11, 1, tzinfo=UTC)
END = datetime(2026, 11, 8, tzinfo=UTC)
GENERATED = datetime(2026, 11, 8, 12, tzinfo=UTC)
TERMS = PriceTerms(input_per_mtok=Decimal(3), cached_input_per_mtok=Decimal("0.3"), output_per_mtok=Decimal(15))
EVIL = "<script>alert(1)</script>"


@dataclass(frozen=True)
class Row:
    """One request, as the report's SQL would group it."""

    tenant: str
    tenant_id: str
    day: int  # days after START
    model: str = "llama-a"
    endpoint_id: str | None = None
    prompt: int = 1000
    cached: int = 0
    output: int = 100


def report(rows: list[Row], group_by: GroupBy, tenant_id: str | None = None) -> BillingReport:
    """What BillingService.report answers for these rows: summed per key, rated, rounded."""
    sums: dict[GroupKey, list[int]] = {}
    for row in rows:
        if tenant_id is not None and row.tenant_id != tenant_id:
            continue
        key: GroupKey = {
            GroupBy.TENANT: (row.tenant, row.tenant_id),
            GroupBy.DAY: ((START + timedelta(days=row.day)).date().isoformat(),),
            GroupBy.ENDPOINT: (row.tenant_id, row.endpoint_id, row.model),
            GroupBy.MODEL: (row.model,),
        }[group_by]
        found = sums.setdefault(key, [0, 0, 0, 0])
        for i, value in enumerate((1, row.prompt - row.cached, row.cached, row.output)):
            found[i] += value
    rounded = round_report(rate(UsageSlice(key, TERMS, *counts) for key, counts in sums.items()))
    return BillingReport(START, END, group_by, "USD", rounded.lines, rounded.totals, rounded.exact_totals)


def page_data(rows: list[Row]) -> BillingPageData:
    """What `page.gather` collects from the service for these rows."""
    by_tenant = report(rows, GroupBy.TENANT)
    return BillingPageData(
        start=START,
        end=END,
        by_tenant=by_tenant,
        by_day=report(rows, GroupBy.DAY),
        by_endpoint=report(rows, GroupBy.ENDPOINT),
        tenant_days={tenant_id: report(rows, GroupBy.DAY, tenant_id) for tenant_id in stacked_tenants(by_tenant)},
    )


class Elements(HTMLParser):
    """Every start tag with its attributes, and the text, of a page."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str | None]]:
        wanted = {name.replace("_", "-"): value for name, value in attrs.items()}
        return [
            found
            for name, found in self.tags
            if name == tag and all(found.get(k) == v or (v == "*" and k in found) for k, v in wanted.items())
        ]


def ids(n: int) -> list[str]:
    return [str(uuid.UUID(int=i + 1)) for i in range(n)]


def chart(page: str, name: str) -> Elements:
    """The elements of one bar chart (an HTML figure) of `page`."""
    return Elements(page.split(f'<figure class="hbars" data-chart="{name}"', 1)[1].split("</figure>", 1)[0])


def test_tenant_and_endpoint_names_are_escaped_everywhere() -> None:
    a, b = ids(2)
    rows = [
        Row(EVIL, a, 0, model=EVIL, endpoint_id=str(uuid.uuid4())),
        Row("a\"b' & <i>", b, 1, model='x" onmouseover="alert(1)', endpoint_id=str(uuid.uuid4())),
    ]
    page = render(page_data(rows), generated_at=GENERATED)
    assert "<script" not in page.lower()
    assert "<i>" not in page
    assert 'onmouseover="' not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    parsed = Elements(page)
    # The browser reads the names back as they were written: escaped, not dropped.
    text = "".join(parsed.text)
    assert EVIL in text
    assert "a\"b' & <i>" in text
    assert not parsed.find("script")
    assert all("onmouseover" not in attrs for _, attrs in parsed.tags)


def test_self_contained_no_script_and_no_url() -> None:
    a, b = ids(2)
    page = render(page_data([Row("acme", a, 0), Row("zeta", b, 3)]), generated_at=GENERATED)
    parsed = Elements(page)
    assert not parsed.find("script")
    assert "http:" not in page and "https:" not in page and "//" not in page
    assert "@import" not in page and "url(" not in page
    for _, attrs in parsed.tags:
        for name in ("src", "href"):
            assert attrs.get(name) in (None, "data:,"), attrs


def test_charts_have_stable_names_titles_and_labels() -> None:
    a, b = ids(2)
    page = render(page_data([Row("acme", a, 0), Row("zeta", b, 3)]), generated_at=GENERATED)
    parsed = Elements(page)
    [cost] = parsed.find("svg", data_chart="*")
    assert cost["data-chart"] == "cost-per-day"
    assert cost["role"] == "img"
    assert cost["aria-labelledby"] == "cost-per-day-title cost-per-day-desc"
    assert parsed.find("title", id="cost-per-day-title")
    assert parsed.find("desc", id="cost-per-day-desc")
    bars = {attrs["data-chart"]: attrs for attrs in parsed.find("figure", data_chart="*")}
    assert set(bars) == {"cache-hit-rate", "top-endpoints"}
    for name, attrs in bars.items():
        assert attrs["aria-labelledby"] == f"{name}-title"
        assert attrs["aria-describedby"] == f"{name}-desc"
        assert parsed.find("span", id=f"{name}-title")
        assert parsed.find("span", id=f"{name}-desc")


def test_long_labels_are_whole_and_no_element_has_a_style_attribute() -> None:
    """Bar labels are HTML text that wraps, never cut to fit (the old SVG cut them to 28 characters); and no
    `style` attribute anywhere, so the same markup works under the console's CSP."""
    (a,) = ids(1)
    tenant = "acme-corporation-with-a-very-long-name"
    rows = [Row(tenant, a, 0, model="loraplex-demo"), Row(tenant, a, 1, model="a-long-endpoint-name", endpoint_id="e1")]
    page = render(page_data(rows), generated_at=GENERATED)
    labels = [
        "".join(found.text).strip()
        for found in (Elements(part.split("</span>", 1)[0]) for part in page.split('<span class="label">')[1:])
    ]
    assert f"loraplex-demo (base) · {tenant}" in labels
    assert f"a-long-endpoint-name · {tenant}" in labels
    assert "…" not in page
    assert all("style" not in attrs for _, attrs in Elements(page).tags)


def test_counts_take_the_right_plural() -> None:
    (a,) = ids(1)
    page = render(page_data([Row("acme", a, 0, prompt=1, cached=0)]), generated_at=GENERATED)
    assert "1 request)" in page and "1 requests" not in page
    assert "0 of 1 prompt token)" in page and "1 prompt tokens" not in page
    assert "1 request<" in page  # the day's tooltip


def test_stacked_bars_one_segment_per_tenant_day_with_the_reports_figures() -> None:
    a, b, c = ids(3)
    rows = [Row("acme", a, day, cached=400) for day in (0, 1, 2)]
    rows += [Row("zeta", b, day, output=2000) for day in (1, 2, 3, 4)]
    rows += [Row("free", c, 2, prompt=0, output=0)]  # no cost: no segment, not in the legend
    data = page_data(rows)
    parsed = Elements(render(data, generated_at=GENERATED))
    segments = parsed.find("rect", **{"class": "segment"})
    expected = {
        (tenant_id, line.key[0], f"{line.cost_total:f}")
        for tenant_id, day_report in data.tenant_days.items()
        for line in day_report.lines
        if line.cost_total > 0
    }
    assert len(expected) == 7
    assert {(s["data-tenant"], s["data-day"], s["data-cost"]) for s in segments} == expected
    assert len(segments) == 7
    legend = [attrs["data-tenant"] for attrs in parsed.find("li", data_tenant="*")]
    assert legend == [b, a]  # costliest first, as stacked
    # Every day of the period has its slot; days without usage just have no bar.
    assert len(parsed.find("g", **{"class": "day"})) == 5


def test_tenants_beyond_the_costliest_share_one_segment() -> None:
    tenants = ids(MAX_STACKED_TENANTS + 2)
    rows = [Row(f"t{i:02d}", tenant, 0, output=100 * (i + 1)) for i, tenant in enumerate(tenants)]
    data = page_data(rows)
    parsed = Elements(render(data, generated_at=GENERATED))
    segments = parsed.find("rect", **{"class": "segment"})
    assert len(segments) == MAX_STACKED_TENANTS + 1
    [other] = [s for s in segments if s["data-tenant"] == "other"]
    day_total = data.by_day.lines[0].cost_total
    stacked = sum(Decimal(str(s["data-cost"])) for s in segments if s["data-tenant"] != "other")
    assert Decimal(str(other["data-cost"])) == day_total - stacked
    assert OTHER_TENANTS in "".join(parsed.text)


def test_hit_rates_are_the_reports_rates_as_percent() -> None:
    a, b = ids(2)
    rows = [Row("acme", a, 0, prompt=3000, cached=1000), Row("zeta", b, 0, prompt=1000, cached=0)]
    hit_rates = chart(render(page_data(rows), generated_at=GENERATED), "cache-hit-rate")
    bars = {attrs["data-id"]: attrs["data-value"] for attrs in hit_rates.find("li", **{"class": "bar"})}
    assert bars[a] == "33.33%"  # the report's 0.3333
    assert bars[b] == "0.00%"


def test_top_endpoints_are_the_costliest_ten() -> None:
    (a,) = ids(1)
    endpoints = [str(uuid.UUID(int=1000 + i)) for i in range(MAX_ENDPOINTS + 3)]
    rows = [Row("acme", a, 0, model=f"ep-{i}", endpoint_id=e, output=1000 * (i + 1)) for i, e in enumerate(endpoints)]
    rows.append(Row("acme", a, 0, model="llama-a"))  # a base model called by name: the cheapest line
    data = page_data(rows)
    bars = chart(render(data, generated_at=GENERATED), "top-endpoints").find("li", **{"class": "bar"})
    assert [bar["data-id"] for bar in bars] == endpoints[::-1][:MAX_ENDPOINTS]
    costs = {line.key[1]: line.cost_total for line in data.by_endpoint.lines}
    assert [bar["data-value"] for bar in bars] == [f"${costs[bar['data-id']]:,f}" for bar in bars]


def test_totals_are_the_reports_totals() -> None:
    a, b = ids(2)
    data = page_data([Row("acme", a, 0, cached=250), Row("zeta", b, 1, output=3)])
    totals = data.by_tenant.totals
    parsed = Elements(render(data, generated_at=GENERATED))
    text = "".join(parsed.text)
    assert f"${totals.cost_total:,f}" in text
    assert f"${totals.cache_savings:,f}" in text
    tokens = totals.input_uncached_tokens + totals.input_cached_tokens + totals.output_tokens
    assert f"{tokens:,}" in text
    assert [attrs["data-total"] for attrs in parsed.find("div", data_total="*")] == [
        "requests",
        "tokens",
        "cost",
        "cache-savings",
    ]


def test_an_empty_period_renders_and_says_so() -> None:
    page = render(page_data([]), generated_at=GENERATED)
    parsed = Elements(page)
    assert NO_USAGE in "".join(parsed.text)
    assert len(parsed.find("svg", data_chart="*")) + len(parsed.find("figure", data_chart="*")) == 3
    assert not parsed.find("rect", **{"class": "segment"})


def test_page_range_defaults_to_thirty_utc_days_and_keeps_the_reports_limits() -> None:
    now = datetime(2026, 11, 29, 13, 30, tzinfo=UTC)
    assert page_range(None, None, now=now) == (datetime(2026, 10, 31, tzinfo=UTC), now)
    start = datetime(2026, 11, 20, tzinfo=UTC)
    assert page_range(start, None, now=now) == (start, now)
    with pytest.raises(ApiError):
        page_range(now - MAX_RANGE - timedelta(seconds=1), now, now=now)
    with pytest.raises(ApiError):
        page_range(now, now, now=now)
