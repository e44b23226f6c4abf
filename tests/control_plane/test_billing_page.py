"""The admin billing page (/admin/billing) on real Postgres: loaded by headless Chromium (Debian's `chromium`, driven
by Playwright) from the platform on a real uvicorn socket, and over plain HTTP for auth, headers and edge cases.

The page's figures are checked against the JSON report (/admin/billing/report) of the same period; the renderer's
finer rules (escaping, structure) are unit-tested in test_billing_page_render.py.
"""

from __future__ import annotations

import os
import struct
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from _support.console import chromium, chromium_executable
from _support.usage_rows import usage_row
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.billing.page import CONTENT_SECURITY_POLICY, page_range
from loraplex.platform.domain.billing.service import BillingService
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.repository import UsageRepository

from .conftest import ADMIN_TOKEN, serving

pytestmark = pytest.mark.integration

Sessions = async_sessionmaker[AsyncSession]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NOW = datetime.now(UTC).replace(microsecond=0)
EVIL = "<script>alert(1)</script>"
CHARTS = ("cost-per-day", "cache-hit-rate", "top-endpoints")


ROW = {"prompt_tokens": 20_000, "completion_tokens": 2_000}  # this module's usual request


def usage(tenant: Tenant, started_at: datetime, **changes: Any) -> dict[str, Any]:
    return usage_row(tenant.id, started_at, **(ROW | changes))


@pytest.fixture
async def seeded(sessions: Sessions) -> dict[str, Tenant]:
    """Three tenants (one with a hostile name) using llama-a on several of the last five UTC days, one of them
    through an endpoint; llama-a priced at 3 / 0.3 / 15 USD per 1M tokens from 40 days ago."""
    async with sessions() as session:
        session.add(BaseModel(name="llama-a", source="/models/llama-a"))
        tenants = {"acme": Tenant(name="acme"), "globex": Tenant(name="globex"), "evil": Tenant(name=EVIL)}
        session.add_all(tenants.values())
        await session.flush()
        await BillingService(session).set_price(
            "llama-a",
            input_per_mtok=Decimal(3),
            cached_input_per_mtok=None,
            output_per_mtok=Decimal(15),
            effective_at=NOW - timedelta(days=40),
        )
        await session.commit()
    endpoint = uuid.uuid4()
    rows = []
    for days in range(5):
        at = NOW - timedelta(days=days, minutes=5)
        rows.append(usage(tenants["acme"], at, cached_tokens=8_000 + 1000 * days))
        rows.append(usage(tenants["acme"], at, endpoint_id=endpoint, model="support-bot", completion_tokens=9_000))
        if days % 2:
            rows.append(usage(tenants["globex"], at, prompt_tokens=50_000, cached_tokens=40_000))
    rows.append(usage(tenants["evil"], NOW - timedelta(days=2, minutes=5), model="llama-a"))
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == len(rows)
        await session.commit()
    return tenants


async def assert_chart_labels_whole(page: Any, width: int) -> None:
    """Every label of the bar charts and of the cost chart's legend shows its whole text at this window width: not
    clipped by its box (scrollWidth within clientWidth), inside the window, and not shortened ("…")."""
    labels = await page.locator("[data-chart] li.bar .label, [data-legend] li .name").evaluate_all(
        """elements => elements.map(e => {
            const box = e.getBoundingClientRect();
            return {text: e.textContent, scroll: e.scrollWidth, client: e.clientWidth,
                    left: box.left, right: box.right, height: box.height};
        })"""
    )
    assert labels, "no chart labels"
    for label in labels:
        assert 0 < label["scroll"] <= label["client"], (
            width,
            label,
        )  # a box of its own (not inline: 0), not overflowed
        assert label["left"] >= 0 and label["right"] <= width, (width, label)
        assert label["height"] > 0, (width, label)
        assert "…" not in label["text"], (width, label)


def iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_chromium_loads_the_page_and_finds_the_charts(
    app: Litestar, seeded: dict[str, Tenant], tmp_path: Path
) -> None:
    # The page's default period, given explicitly so that the report below covers the same one.
    start = iso(page_range(None, None, now=datetime.now(UTC))[0])
    with serving(app) as url:
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as http:
            # The figures the page must show, from the JSON report of the page's default period.
            by_tenant = (await http.get("/admin/billing/report", params={"group_by": "tenant", "start": start})).json()
            expected_segments: set[tuple[str, str, str]] = set()
            for row in by_tenant["rows"]:
                response = await http.get(
                    "/admin/billing/report", params={"group_by": "day", "start": start, "tenant_id": row["tenant_id"]}
                )
                for day in response.json()["rows"]:
                    if Decimal(day["cost_total"]) > 0:
                        expected_segments.add((row["tenant_id"], day["day"], day["cost_total"]))
        # acme on 5 days, globex on 2, the hostile name on 1.
        assert len(expected_segments) == 8

        async with chromium() as browser:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            requested: list[str] = []
            problems: list[str] = []
            page.on("request", lambda request: requested.append(request.url))
            page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
            page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))
            await page.set_extra_http_headers(ADMIN)

            response = await page.goto(f"{url}/admin/billing?start={start}", wait_until="load")
            assert response is not None and response.status == 200
            assert response.headers["content-type"].startswith("text/html")
            assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY

            for chart in CHARTS:
                located = page.locator(f'[data-chart="{chart}"]')
                assert await located.count() == 1, chart
                assert await located.is_visible(), chart
                box = await located.bounding_box()
                assert box is not None and box["width"] > 300 and box["height"] > 50, (chart, box)

            segments = await page.locator('svg[data-chart="cost-per-day"] rect.segment').evaluate_all(
                "rects => rects.map(r => [r.dataset.tenant, r.dataset.day, r.dataset.cost,"
                " r.getBoundingClientRect().height])"
            )
            assert {(t, d, c) for t, d, c, _ in segments} == expected_segments
            assert len(segments) == len(expected_segments)
            assert all(height > 0 for *_, height in segments)

            legend = await page.locator('[data-legend="cost-per-day"] li').all_inner_texts()
            assert sorted(text.strip() for text in legend) == sorted(["acme", "globex", EVIL])
            hit_rates = await page.locator('[data-chart="cache-hit-rate"] li.bar').count()
            assert hit_rates == 3
            endpoints = await page.locator('[data-chart="top-endpoints"] li.bar').all_text_contents()
            assert any("support-bot · acme" in text for text in endpoints), endpoints
            total = await page.locator('[data-total="cost"] .value').inner_text()
            assert total == f"${Decimal(by_tenant['totals']['cost_total']):,f}"

            screenshot = tmp_path / "billing-page.png"
            await page.screenshot(path=screenshot, full_page=True)
            for width in (1280, 390):
                await page.set_viewport_size({"width": width, "height": 900})
                await assert_chart_labels_whole(page, width)
                overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                assert overflow <= 0, (width, overflow)

    assert problems == []
    assert requested, "the page made no request at all"
    for address in requested:
        parts = urlsplit(address)
        assert parts.scheme == "data" or parts.hostname == "127.0.0.1", address
    data = screenshot.read_bytes()
    width, height = png_size(data)
    assert width >= 1200 and height >= 900, (width, height)
    assert len(data) > 20_000  # charts and text, not a blank page


async def test_only_admins_see_the_page(client: AsyncTestClient[Litestar], make_tenant: Any) -> None:
    _, key = await make_tenant("acme")
    for headers in ({}, {"Authorization": f"Bearer {key}"}, {"Authorization": "Bearer not-the-admin-token"}):
        response = await client.get("/admin/billing", headers=headers)
        assert response.status_code == 401, headers
        assert "<svg" not in response.text


async def test_an_empty_period_still_renders(client: AsyncTestClient[Litestar]) -> None:
    response = await client.get(
        "/admin/billing", params={"start": "2020-01-01T00:00:00Z", "end": "2020-01-08T00:00:00Z"}, headers=ADMIN
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "no usage in this period" in response.text.lower()
    for chart in CHARTS:
        assert f'data-chart="{chart}"' in response.text
    # The report's own route is still the report.
    report = await client.get("/admin/billing/report", headers=ADMIN)
    assert report.status_code == 200 and report.json()["object"] == "billing.report"


async def test_the_reports_range_rules_apply(client: AsyncTestClient[Litestar]) -> None:
    for params in (
        {"start": "2020-01-01", "end": "2020-06-01"},  # longer than the report allows
        {"start": "2020-01-02", "end": "2020-01-01"},
        {"start": "yesterday"},
    ):
        response = await client.get("/admin/billing", params=params, headers=ADMIN)
        assert response.status_code == 400, (params, response.text)


def test_without_chromium_the_browser_test_fails_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda *_args, **_kwargs: False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(pytest.fail.Exception, match="apt-get install chromium"):
        chromium_executable()
