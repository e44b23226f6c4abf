"""The tenant's Usage page (/console/usage) and its CSV, over HTTP on real Postgres: its figures are those of the admin
billing report (by day, for the tenant) of the same period, never another tenant's; one Chromium look at 1280 and
390 px. The chart view models (console/charts.py) are unit-tested at the end."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from _support.console import BrowserProblems, chromium, review, sign_in
from _support.usage_rows import usage_row
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.console.charts import MIN_VISIBLE_PERCENT, Series, bar_chart, percent, stacked_chart
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.billing.service import BillingService
from loraplex.platform.domain.usage.repository import UsageRepository

from .conftest import ADMIN_TOKEN, serving

pytestmark = pytest.mark.integration

Sessions = async_sessionmaker[AsyncSession]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# A past week, so that the figures do not depend on today: acme uses it on the 3rd (1 request) and the 5th (2
# requests, one through an endpoint), globex on the 5th through an endpoint only it has.
START, END = "2025-03-01", "2025-03-07"
PERIOD = {"start": START, "end": END}
REPORT_PERIOD = {"start": "2025-03-01T00:00:00Z", "end": "2025-03-08T00:00:00Z"}  # the end date included
GLOBEX_ENDPOINT = "globex-secret-bot"
LONG_ENDPOINT = "support-bot-for-the-customer-service-team-of-the-northern-region-" + "x" * 40


def at(day: str, hour: int = 12) -> datetime:
    return datetime.combine(date.fromisoformat(day), datetime.min.time(), tzinfo=UTC) + timedelta(hours=hour)


ROW = {"prompt_tokens": 20_000, "cached_tokens": 8_000, "completion_tokens": 2_000}  # this module's usual request


def usage(tenant_id: str, started_at: datetime, **changes: Any) -> dict[str, Any]:
    return usage_row(tenant_id, started_at, **(ROW | changes))


async def seed(sessions: Sessions, rows: list[dict[str, Any]]) -> None:
    """llama-a, priced at 3 / 0.3 / 15 USD per 1M tokens from long before any row, and the usage rows."""
    async with sessions() as session:
        session.add(BaseModel(name="llama-a", source="/models/llama-a"))
        await session.flush()
        await BillingService(session).set_price(
            "llama-a",
            input_per_mtok=Decimal(3),
            cached_input_per_mtok=None,
            output_per_mtok=Decimal(15),
            effective_at=datetime(2024, 1, 1, tzinfo=UTC),
        )
        await session.commit()
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == len(rows)
        await session.commit()


@pytest.fixture
async def acme(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], sessions: Sessions
) -> tuple[str, str, str]:
    """(acme's id, acme's key, globex's id), with the week's usage seeded and acme signed in."""
    acme_tenant, acme_key = await make_tenant("acme")
    globex_tenant, _ = await make_tenant("globex")
    acme_id, globex_id = acme_tenant["id"], globex_tenant["id"]
    await seed(
        sessions,
        [
            usage(acme_id, at("2025-03-03")),
            usage(acme_id, at("2025-03-05", 9)),
            usage(
                acme_id, at("2025-03-05", 10), endpoint_id=uuid.uuid4(), model="support-bot", completion_tokens=9_000
            ),
            usage(globex_id, at("2025-03-05"), endpoint_id=uuid.uuid4(), model=GLOBEX_ENDPOINT, prompt_tokens=90_000),
        ],
    )
    assert (await sign_in(client, acme_key)).status_code in (200, 303)
    return acme_id, acme_key, globex_id


def card(page: str, name: str) -> str:
    found = re.search(
        rf'data-total="{name}">\s*<div class="total-label">[^<]*</div>\s*<div class="total-value">([^<]*)<', page
    )
    assert found is not None, f"no {name} card"
    return html.unescape(found.group(1))


def table_rows(page: str, table: str) -> list[list[str]]:
    body = page.split(f'data-table="{table}"', 1)[1].split("</table>", 1)[0]
    return [
        [html.unescape(cell.strip()) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body.split("<tbody>", 1)[1], re.S)
    ]


def usd(amount: str) -> str:
    return f"${Decimal(amount):,f}"


async def test_the_page_shows_the_billing_reports_figures_for_the_period(
    client: AsyncTestClient[Litestar], acme: tuple[str, str, str]
) -> None:
    acme_id, _, _ = acme
    response = await client.get("/console/usage", params=PERIOD)
    assert response.status_code == 200, response.text
    page = response.text
    report = (
        await client.get(
            "/admin/billing/report", params={**REPORT_PERIOD, "group_by": "day", "tenant_id": acme_id}, headers=ADMIN
        )
    ).json()
    totals = report["totals"]
    assert totals["requests"] == 3  # acme's three, not globex's
    assert card(page, "requests") == "3"
    tokens = totals["input_uncached_tokens"] + totals["input_cached_tokens"] + totals["output_tokens"]
    assert card(page, "tokens") == f"{tokens:,}"
    assert f"{totals['input_cached_tokens']:,} cached input" in page
    assert card(page, "cost") == usd(totals["cost_total"])
    assert card(page, "cache-savings") == usd(totals["cache_savings"])
    assert card(page, "cache-hit-rate") == f"{totals['cache_hit_rate'] * 100:.2f}%"
    # The bill per day: the report's rows, then its totals.
    days = table_rows(page, "days")
    assert [row[0] for row in days] == [row["day"] for row in report["rows"]] + ["Total"]
    for shown, expected in zip(days, [*report["rows"], totals], strict=True):
        assert shown[1] == f"{expected['requests']:,}"
        assert shown[-1] == usd(expected["cost_total"])
    # The bill per endpoint adds up to the same totals.
    endpoints = table_rows(page, "endpoints")
    assert {row[0] for row in endpoints} == {"support-bot", "llama-a (base model)", "Total"}
    assert endpoints[-1][-1] == usd(totals["cost_total"])
    # One chart each, one bar per day with usage; a day of one request says so in the singular.
    for chart in ("requests", "tokens", "cached-tokens", "cost"):
        assert page.count(f'data-chart="{chart}"') == 1, chart
    requests_chart = page.split('data-chart="requests"', 1)[1].split("</figure>", 1)[0]
    assert re.findall(r'<span class="value">([^<]*)</span>', requests_chart) == ["1 request", "2 requests"]
    assert "1 requests" not in page
    assert 'width="100.0%"' in requests_chart and 'width="50.0%"' in requests_chart
    assert 'href="/console/usage.csv?start=2025-03-01&amp;end=2025-03-07"' in page
    assert 'value="2025-03-01"' in page and 'value="2025-03-07"' in page


async def test_another_tenants_usage_never_appears(
    client: AsyncTestClient[Litestar], acme: tuple[str, str, str]
) -> None:
    page = (await client.get("/console/usage", params=PERIOD)).text
    csv = (await client.get("/console/usage.csv", params=PERIOD)).text
    assert GLOBEX_ENDPOINT not in page
    assert "90,000" not in page and "90000" not in csv
    assert card(page, "requests") == "3"


async def test_the_csv_is_the_reports_per_day_bill(
    client: AsyncTestClient[Litestar], acme: tuple[str, str, str]
) -> None:
    acme_id, _, _ = acme
    response = await client.get("/console/usage.csv", params=PERIOD)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/csv")
    assert response.headers["content-disposition"] == 'attachment; filename="usage-2025-03-01-to-2025-03-07.csv"'
    expected = await client.get(
        "/admin/billing/report",
        params={**REPORT_PERIOD, "group_by": "day", "tenant_id": acme_id, "format": "csv"},
        headers=ADMIN,
    )
    assert response.text == expected.text
    lines = response.text.splitlines()
    assert lines[0].startswith("day,requests,")
    assert [line.split(",")[0] for line in lines[1:]] == ["2025-03-03", "2025-03-05", "total"]


async def test_a_bad_period_re_renders_the_form_with_the_error(
    client: AsyncTestClient[Litestar], acme: tuple[str, str, str]
) -> None:
    for params, words in (
        ({"start": "2025-03-07", "end": "2025-03-01"}, "before"),
        ({"start": "2024-01-01", "end": "2024-12-31"}, "at most 92 days"),
        ({"start": "last tuesday"}, "YYYY-MM-DD"),
        ({"end": "9999-12-31"}, "future"),
    ):
        response = await client.get("/console/usage", params=params)
        assert response.status_code == 400, (params, response.text)
        assert response.headers["content-type"].startswith("text/html")
        assert 'role="alert"' in response.text and words in response.text, params
        assert 'type="date"' in response.text  # the form is still there to fix it
        assert "data-total" not in response.text
        csv = await client.get("/console/usage.csv", params=params)
        assert csv.status_code == 400 and csv.headers["content-type"].startswith("text/html"), params


async def test_an_empty_period_says_so(client: AsyncTestClient[Litestar], acme: tuple[str, str, str]) -> None:
    response = await client.get("/console/usage", params={"start": "2025-01-01", "end": "2025-01-31"})
    assert response.status_code == 200
    assert "No usage in this period." in response.text
    assert "data-chart" not in response.text and "data-total" not in response.text


async def test_the_default_period_is_the_last_30_utc_days(
    client: AsyncTestClient[Litestar], acme: tuple[str, str, str]
) -> None:
    response = await client.get("/console/usage")
    assert response.status_code == 200
    today = datetime.now(UTC).date()
    assert f'id="start" name="start" type="date" value="{today - timedelta(days=29)}"' in response.text
    assert f'id="end" name="end" type="date" value="{today}"' in response.text


async def test_chromium_shows_the_page_at_both_widths(app: Litestar, sessions: Sessions) -> None:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    with serving(app) as url:
        # The tenant made through the admin API of the served app (a test client would start a second lifespan).
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
            tenant = (await admin.post("/admin/tenants", json={"name": "acme"})).json()
            key = (await admin.post(f"/admin/tenants/{tenant['id']}/api-keys", json={"name": "browser"})).json()["key"]
        rows, endpoint_id = [], uuid.uuid4()
        for days_ago in range(7):
            for n in range(days_ago % 3 + 1):
                endpoint = endpoint_id if n == 1 else None
                started = today - timedelta(days=days_ago) + timedelta(minutes=10 + n)
                model = LONG_ENDPOINT if n == 1 else "llama-a"
                rows.append(
                    usage(tenant["id"], started, model=model, endpoint_id=endpoint, cached_tokens=1000 * days_ago)
                )
        await seed(sessions, rows)
        async with chromium() as browser:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            problems = BrowserProblems(page, url)
            await page.goto(f"{url}/console")
            await page.fill("#key", key)
            await page.click("button[type=submit]")
            await page.wait_for_url(f"{url}/console/playground")
            await page.goto(f"{url}/console/usage")
            assert await page.locator("[data-chart]").count() == 4
            assert await page.locator('[data-chart="requests"] .bars li').count() == 7
            label = page.locator('[data-table="endpoints"] td', has_text=LONG_ENDPOINT)
            assert await label.inner_text() == LONG_ENDPOINT  # whole, wrapped
            await review(page, "usage")
            async with page.expect_download() as download:
                await page.click("[data-csv]")
            assert (await download.value).suggested_filename.startswith("usage-")
            problems.check()


# --- the chart view models ----------------------------------------------------------------------------------------


class TestBarChart:
    def test_bars_are_shares_of_the_largest_value(self) -> None:
        chart = bar_chart("c", "C", [("a", 10, "10"), ("b", 5, "5"), ("c", 2.5, "2.5"), ("d", 0, "0")])
        widths = [[s.width for s in row.segments] for row in chart.rows]
        assert widths == [["100.0%"], ["50.0%"], ["25.0%"], []]
        assert [row.value_text for row in chart.rows] == ["10", "5", "2.5", "0"]
        assert chart.legend == ()

    def test_a_zero_maximum_draws_no_bars(self) -> None:
        chart = bar_chart("c", "C", [("a", 0, "0 requests"), ("b", 0, "0 requests")])
        assert [row.segments for row in chart.rows] == [(), ()]
        assert bar_chart("c", "C", []).rows == ()

    def test_a_tiny_value_still_shows_a_mark(self) -> None:
        chart = bar_chart("c", "C", [("a", 100_000, ""), ("b", 1, "")])
        assert chart.rows[1].segments[0].width == f"{MIN_VISIBLE_PERCENT:.1f}%"

    def test_long_labels_are_kept_whole(self) -> None:
        label = "an endpoint with a very long name " * 5
        assert bar_chart("c", "C", [(label, 1, "1")]).rows[0].label == label

    def test_negative_values_are_refused(self) -> None:
        with pytest.raises(ValueError, match="negative"):
            bar_chart("c", "C", [("a", -1, "")])
        assert percent(3, 0) == 0.0
        assert percent(1, 3) == 33.3


class TestStackedChart:
    SERIES = (Series("input", "Input"), Series("cached", "Cached"), Series("output", "Output"))

    def test_segments_meet_and_the_longest_bar_fills_the_box(self) -> None:
        chart = stacked_chart("t", "T", self.SERIES, [("a", (1, 1, 1), "3"), ("b", (1, 0, 0.5), "1.5")])
        first, second = chart.rows
        assert [(s.series, s.x, s.width) for s in first.segments] == [
            ("input", "0%", "33.3%"),
            ("cached", "33.3%", "33.4%"),
            ("output", "66.7%", "33.3%"),
        ]
        # An empty part draws nothing, and the next one starts where the last drawn one ended.
        assert [(s.series, s.x, s.width) for s in second.segments] == [
            ("input", "0%", "33.3%"),
            ("output", "33.3%", "16.7%"),
        ]
        assert chart.legend == self.SERIES

    def test_a_row_needs_a_part_per_series(self) -> None:
        with pytest.raises(ValueError, match="3 series"):
            stacked_chart("t", "T", self.SERIES, [("a", (1, 2), "")])
        assert stacked_chart("t", "T", self.SERIES, [("a", (0, 0, 0), "0")]).rows[0].segments == ()
