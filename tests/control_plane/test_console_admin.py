"""The console's admin pages (/console/admin: tenants, models & prices, billing, fleet) on real Postgres and Redis.

Over HTTP as a browser sends its forms: an admin creates, suspends (its key and console session end at once),
resumes and re-terms a tenant, registers a base model, sets prices (a bad one is refused with nothing written) and
sees the bill change; the billing CSV; tenants get 403 everywhere here. In Chromium, on the platform with the
embedded demo engine: the same through the pages, with a real completion billed, every chart label whole at 1280 and
390 px, and no CSP violation.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from _support.console import BrowserProblems, chromium, csrf_token, other_browser, page_token, review, sign_in
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine.serve import FleetRecord
from loraplex.platform.console.controllers.admin_tenants import LIMITS
from loraplex.platform.dependencies import resources_of
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.fleet.registry import EmptyFleet
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.tenants.schemas import LIMIT_FIELDS
from loraplex.platform.domain.usage.repository import UsageRepository

from .conftest import ADMIN_TOKEN
from .test_billing_page import assert_chart_labels_whole, usage

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN_PAGES = ("/console/admin/tenants", "/console/admin/models", "/console/admin/billing", "/console/admin/fleet")
NEW_KEY = re.compile(r'<code id="new-key">([^<]+)</code>')
CREATED_TENANT = re.compile(r'data-created-tenant="([0-9a-f-]{36})"')
COST = re.compile(r'data-total="cost">\s*<div class="label">Cost</div>\s*<div class="value">([^<]+)</div>')

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(autouse=True)
def _no_redirects(client: AsyncTestClient[Litestar]) -> None:
    client.follow_redirects = False


async def post_form(client: AsyncTestClient[Litestar], path: str, form_page: str, fields: dict[str, str]) -> Any:
    """Post a form of `form_page` (a signed-in page) as the browser would: its CSRF token and `fields`."""
    token = await page_token(client, form_page)
    return await client.post(path, data={"csrf_token": token, **fields})


async def create_tenant(client: AsyncTestClient[Litestar], name: str, **fields: str) -> str:
    response = await post_form(client, "/console/admin/tenants", "/console/admin/tenants", {"name": name, **fields})
    assert response.status_code == 201, response.text
    found = CREATED_TENANT.search(response.text)
    assert found is not None, response.text
    return found.group(1)


async def test_an_admin_creates_suspends_resumes_and_sets_the_terms_of_a_tenant(
    client: AsyncTestClient[Litestar],
) -> None:
    assert (await sign_in(client, ADMIN_TOKEN)).headers["location"] == "/console/admin/tenants"
    tenant_id = await create_tenant(client, "acme", requests_per_minute="600")
    listed = await client.get("/console/admin/tenants")
    assert "1 tenant<" in listed.text and "1 tenants" not in listed.text
    assert f'data-tenant-id="{tenant_id}"' in listed.text
    api = (await client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()
    assert api["status"] == "active" and api["limits"]["requests_per_minute"] == 600

    # A key for it, shown once in the answer to the POST (never in a URL or a later page).
    page_path = f"/console/admin/tenants/{tenant_id}"
    response = await post_form(client, f"{page_path}/api-keys", page_path, {"name": "onboarding"})
    assert response.status_code == 201
    found = NEW_KEY.search(response.text)
    assert found is not None
    key = found.group(1)
    again = await client.get(page_path)
    assert key not in again.text and "1 key<" in again.text
    tenant_api = {"Authorization": f"Bearer {key}"}
    assert (await client.get("/v1/models", headers=tenant_api)).status_code == 200

    with other_browser(client) as tenant_browser:
        assert (await sign_in(tenant_browser, key)).status_code == 303
        assert (await tenant_browser.get("/console/keys")).status_code == 200
        tenant_cookies = tenant_browser.cookies

    # Suspended: its key gets 401 at once, and its console session is over.
    response = await post_form(client, f"{page_path}/status", page_path, {"status": "suspended", "back": "tenant"})
    assert response.status_code == 303 and response.headers["location"] == page_path
    assert (await client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()["status"] == "suspended"
    assert (await client.get("/v1/models", headers=tenant_api)).status_code == 401
    with other_browser(client) as tenant_browser:
        tenant_browser.cookies = tenant_cookies
        ended = await tenant_browser.get("/console/keys")
        assert ended.status_code == 303 and ended.headers["location"].startswith("/console")
    shown = await client.get(page_path)
    assert '<span class="badge suspended">suspended</span>' in shown.text
    assert 'data-action="resume"' in shown.text

    # Resumed from the list.
    response = await post_form(client, f"{page_path}/status", "/console/admin/tenants", {"status": "active"})
    assert response.status_code == 303 and response.headers["location"] == "/console/admin/tenants"
    assert (await client.get("/v1/models", headers=tenant_api)).status_code == 200

    # Terms: every limit of the form is set (blank: back to the platform's default), the weight and the tiers.
    terms = {
        "fairness_weight": "2.5",
        "service_tiers": "default,priority",
        "requests_per_minute": "",
        "tokens_per_minute": "90000",
        "key_requests_per_minute": "",
        "key_tokens_per_minute": "",
        "max_concurrent_requests": "4",
    }
    response = await post_form(client, page_path, page_path, terms)
    assert response.status_code == 200 and "Saved." in response.text
    api = (await client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()
    assert api["fairness_weight"] == 2.5
    assert api["service_tiers"] == ["default", "priority"]
    assert api["limits"] == {
        "requests_per_minute": None,
        "tokens_per_minute": 90000,
        "key_requests_per_minute": None,
        "key_tokens_per_minute": None,
        "max_concurrent_requests": 4,
    }
    assert 'value="90000"' in response.text and '<option value="default,priority" selected>' in response.text

    # Back to the platform's tiers; a bad limit is refused, the page says which, and nothing changes.
    response = await post_form(client, page_path, page_path, {**terms, "service_tiers": "platform"})
    assert response.status_code == 200
    assert (await client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()["service_tiers"] == [
        "flex",
        "default",
    ]
    response = await post_form(client, page_path, page_path, {**terms, "max_concurrent_requests": "0"})
    assert response.status_code == 400
    assert "Max concurrent requests: Input should be greater than or equal to 1." in response.text
    assert (await client.get(f"/admin/tenants/{tenant_id}", headers=ADMIN)).json()["limits"][
        "max_concurrent_requests"
    ] == 4


async def test_the_tenant_forms_refuse_a_duplicate_name_and_bad_numbers(client: AsyncTestClient[Litestar]) -> None:
    await sign_in(client, ADMIN_TOKEN)
    await create_tenant(client, "acme")
    response = await post_form(client, "/console/admin/tenants", "/console/admin/tenants", {"name": "acme"})
    assert response.status_code == 409
    assert "A tenant named &#39;acme&#39; already exists." in response.text
    response = await post_form(
        client, "/console/admin/tenants", "/console/admin/tenants", {"name": "globex", "fairness_weight": "lots"}
    )
    assert response.status_code == 400 and "Fairness weight:" in response.text
    assert 'value="globex"' in response.text  # the admin's input is kept
    listed = (await client.get("/admin/tenants", headers=ADMIN)).json()["data"]
    assert [tenant["name"] for tenant in listed] == ["acme"]
    response = await post_form(
        client, f"/console/admin/tenants/{uuid.uuid4()}/status", "/console/admin/tenants", {"status": "suspended"}
    )
    assert response.status_code == 404


def test_the_terms_form_has_an_input_for_every_limit_the_api_knows() -> None:
    assert tuple(field.name for field in LIMITS) == LIMIT_FIELDS


async def test_an_admin_registers_a_model_sets_prices_and_the_bill_follows(
    client: AsyncTestClient[Litestar], sessions: Sessions, tiny_base_checkpoint: Path
) -> None:
    await sign_in(client, ADMIN_TOKEN)
    models = "/console/admin/models"
    response = await post_form(client, models, models, {"name": "tiny", "source": "/no/such/checkpoint"})
    assert response.status_code == 400 and "cannot be served" in response.text
    response = await post_form(client, models, models, {"name": "tiny", "source": str(tiny_base_checkpoint)})
    assert response.status_code == 201, response.text
    assert "Base model tiny registered." in response.text
    assert "1 base model<" in response.text
    registered = (await client.get("/admin/base-models", headers=ADMIN)).json()["data"]
    assert [(m["name"], m["source"], m["status"]) for m in registered] == [("tiny", str(tiny_base_checkpoint), "ready")]

    now = datetime.now(UTC).replace(second=0, microsecond=0)
    async with sessions() as session:
        tenant = Tenant(name="acme")
        session.add(tenant)
        await session.commit()

    async def seed(at: datetime) -> None:
        async with sessions() as session:
            assert await UsageRepository(session).add_if_absent([usage(tenant, at, model="tiny", base_model="tiny")])
            await session.commit()

    async def bill() -> str:
        start = (now - timedelta(days=5)).date().isoformat()
        response = await client.get("/console/admin/billing", params={"start": start})
        assert response.status_code == 200, response.text
        found = COST.search(response.text)
        assert found is not None, response.text
        return found.group(1)

    # A request before any price: rated 0.
    await seed(now - timedelta(days=3))
    assert await bill() == "$0.000000"

    # Bad prices: the page says why, keeps the input, and nothing is written.
    price = {"base_model": "tiny", "service_tier": "default", "input_per_mtok": "3", "output_per_mtok": "15"}
    for bad, message in (
        ({"input_per_mtok": "three"}, "Input price (USD per 1M tokens): "),
        ({"output_per_mtok": "-1"}, "Output price (USD per 1M tokens): Input should be greater than or equal to 0."),
        ({"input_per_mtok": "0.0000000001"}, "no more than 9 decimal places"),
        ({"cached_input_per_mtok": "4"}, "must not exceed"),
        ({"effective_at": (now - timedelta(days=4)).strftime("%Y-%m-%dT%H:%M")}, "already recorded"),
    ):
        response = await post_form(client, "/console/admin/prices", models, {**price, **bad})
        assert response.status_code in (400, 409), (bad, response.status_code)
        assert message in response.text, (bad, response.text)
        assert f'value="{next(iter(bad.values()))}"' in response.text
    assert (await client.get("/admin/prices", headers=ADMIN)).json()["data"] == []

    # A price from two days ago (after that request: it stays unrated), then a request it rates.
    effective = (now - timedelta(days=2)).strftime("%Y-%m-%dT%H:%M")
    response = await post_form(client, "/console/admin/prices", models, {**price, "effective_at": effective})
    assert response.status_code == 201, response.text
    assert "tiny (default tier): 3 / 0.3 / 15 USD per 1M tokens" in response.text
    await seed(now - timedelta(days=1))
    # 20,000 prompt tokens at $3 and 2,000 completion tokens at $15 per million.
    assert await bill() == "$0.090000"

    # A second version from now on: the book shows both, the new one current.
    response = await post_form(client, "/console/admin/prices", models, {**price, "input_per_mtok": "4"})
    assert response.status_code == 201
    book = (await client.get(models)).text
    assert book.count('data-status="current"') == 1 and book.count('data-status="superseded"') == 1
    assert await bill() == "$0.090000"  # the past is not re-rated


async def test_the_billing_page_csv_and_period_form(client: AsyncTestClient[Litestar], sessions: Sessions) -> None:
    async with sessions() as session:
        tenant = Tenant(name="acme-corporation-with-a-long-name")
        session.add(tenant)
        await session.commit()
    now = datetime.now(UTC)
    async with sessions() as session:
        await UsageRepository(session).add_if_absent([usage(tenant, now - timedelta(hours=2))])
        await session.commit()
    await sign_in(client, ADMIN_TOKEN)

    response = await client.get("/console/admin/billing")
    assert response.status_code == 200
    text = response.text
    assert '<link rel="stylesheet" href="/console/admin/billing.css">' in text
    assert "style=" not in text and "<style" not in text  # the console's CSP allows no inline style
    assert "llama-a (base) · acme-corporation-with-a-long-name" in text  # whole, not cut
    assert "(1 request)" in text and "1 requests" not in text
    assert f'name="start" type="date" value="{(now - timedelta(days=29)).date().isoformat()}"' in text
    assert f'name="end" type="date" value="{now.date().isoformat()}"' in text

    css = await client.get("/console/admin/billing.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert ".billing .rows" in css.text

    found = re.search(r'href="(/console/admin/billing\.csv\?[^"]+group_by=tenant)"', text)
    assert found is not None
    download = await client.get(found.group(1).replace("&amp;", "&"))
    assert download.status_code == 200
    assert download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"].startswith('attachment; filename="billing-tenant-')
    lines = download.text.splitlines()
    assert lines[0].startswith("tenant_name,tenant_id,requests,")
    assert lines[1].startswith(f"acme-corporation-with-a-long-name,{tenant.id},1,")
    assert lines[-1].startswith("total,,1,")
    by_day = await client.get("/console/admin/billing.csv", params={"group_by": "day"})
    assert by_day.status_code == 200 and by_day.text.startswith("day,")

    # Whole days: the "to" day is included; a bad period says so on the page.
    day = now.date().isoformat()
    response = await client.get("/console/admin/billing", params={"start": day, "end": day})
    assert response.status_code == 200 and f"{day} 00:00 to " in response.text
    response = await client.get("/console/admin/billing", params={"start": day, "end": "2020-01-01"})
    assert response.status_code == 400 and "&#39;start&#39; must be before &#39;end&#39;." in response.text
    assert 'data-form="period"' in response.text


async def test_the_fleet_page_says_when_no_engine_runs(client: AsyncTestClient[Litestar]) -> None:
    await sign_in(client, ADMIN_TOKEN)
    response = await client.get("/console/admin/fleet")
    assert response.status_code == 200
    assert "No engine is running" in response.text


class AnnouncedFleet(EmptyFleet):
    """The fleet as the registry would read it: these records (routing is not what this page does)."""

    def __init__(self, records: list[FleetRecord]) -> None:
        self.records = records

    async def replicas(self) -> list[FleetRecord]:
        return self.records


async def test_the_fleet_page_shows_each_engine_and_names_its_resident_adapters(
    client: AsyncTestClient[Litestar], sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    known, unknown = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32
    async with sessions() as session:
        base = BaseModel(name="llama-a", source="/models/llama-a")
        tenants = [Tenant(name="acme"), Tenant(name="globex")]
        session.add_all([base, *tenants])
        await session.flush()
        # The same files uploaded by two tenants: one digest, two adapters.
        session.add_all(
            Adapter(
                tenant_id=tenant.id,
                name="support",
                version=version,
                base_model_id=base.id,
                status="ready",
                digest=known,
            )
            for tenant, version in ((tenants[0], 2), (tenants[1], 1))
        )
        await session.commit()
    record = FleetRecord(
        id="gpu-1:8100",
        url="http://gpu-1:8100",
        base_model="llama-a",
        adapters=frozenset({known, unknown}),
        free_pages=500,
        evictable_pages=250,
        num_pages=1000,
        num_waiting=1,
        num_running=2,
        max_model_len=8192,
        updated_at=time.time() - 3,
    )
    monkeypatch.setattr(resources_of(client.app.state), "fleet", AnnouncedFleet([record]))
    await sign_in(client, ADMIN_TOKEN)
    text = (await client.get("/console/admin/fleet")).text
    assert "1 engine<" in text and 'data-engine="gpu-1:8100"' in text
    assert "1 request waiting" in text and ">2 requests<" in text and "8,192 tokens" in text
    assert "500 free, 250 evictable, of 1,000 pages" in " ".join(text.split())
    assert re.search(r"[34] s ago", text)
    assert 'width="25.00%"' in text and 'x="25.00%"' in text  # in use, then evictable
    assert "2 resident adapters" in text
    assert "acme / support v2, globex / support v1" in text
    assert f'data-digest="{unknown}"' in text and "cdcdcdcdcdcd</code>" in text and "(no adapter on record)" in text


async def test_tenants_get_403_on_every_admin_page_and_strangers_are_sent_to_sign_in(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    for path in ADMIN_PAGES:
        response = await client.get(path)
        assert response.status_code == 303 and response.headers["location"].startswith("/console"), path
    _, key = await make_tenant("acme")
    await sign_in(client, key)
    token = await page_token(client, "/console/keys")
    for path in (*ADMIN_PAGES, "/console/admin/billing.csv", "/console/admin/billing.css"):
        response = await client.get(path)
        assert response.status_code == 403, path
        assert "This page is for admins." in response.text
    for path in ("/console/admin/tenants", "/console/admin/prices", "/console/admin/models"):
        response = await client.post(path, data={"csrf_token": token, "name": "mine"})
        assert response.status_code == 403, path
    assert [t["name"] for t in (await client.get("/admin/tenants", headers=ADMIN)).json()["data"]] == ["acme"]


# --- in Chromium ---------------------------------------------------------------------------------------------------

DEMO = "loraplex-demo"
TENANT = "acme-corporation"


async def test_chromium_admin_creates_a_tenant_prices_the_model_and_sees_the_bill(
    demo_platform: tuple[Litestar, str],
) -> None:
    _, url = demo_platform
    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        problems = BrowserProblems(page, url)
        await page.goto(f"{url}/console")
        await page.fill("#key", ADMIN_TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{url}/console/admin/tenants")

        await page.fill("#tenant-name", TENANT)
        await page.click("button:has-text('Create tenant')")
        await page.wait_for_selector("[data-created-tenant]")
        await review(page, "admin-tenants")
        await page.click(f"[data-table=tenants] a:text-is('{TENANT}')")
        await page.click("button:has-text('Create an API key')")
        key = (await page.inner_text("#new-key")).strip()
        await review(page, "admin-tenant")

        await page.goto(f"{url}/console/admin/models")
        assert await page.locator(f'[data-model="{DEMO}"]').count() == 1
        await page.select_option("#price-model", DEMO)
        await page.fill("#price-input", "3")
        await page.fill("#price-output", "15")
        await page.click("button:has-text('Add price version')")
        await page.wait_for_selector("[data-status=current]")
        await review(page, "admin-models")

        # A request of the tenant's, after the price: billed at it.
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as api:
            answer = await api.post(
                "/v1/chat/completions",
                json={"model": DEMO, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
        since = f"{datetime.now(UTC) - timedelta(days=1):%Y-%m-%dT%H:%M:%SZ}"
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
            for _ in range(100):  # usage rows are written by a background drainer
                report = (await admin.get("/admin/billing/report", params={"start": since})).json()
                if report["totals"]["requests"] == 1:
                    break
                await asyncio.sleep(0.1)
        expected = Decimal(report["totals"]["cost_total"])
        assert expected > 0
        await page.goto(f"{url}/console/admin/billing")
        assert await page.inner_text('[data-total="cost"] .value') == f"${expected:,f}"
        label = page.locator('[data-chart="top-endpoints"] li.bar .label')
        assert await label.all_inner_texts() == [f"{DEMO} (base) · {TENANT}"]
        for width in (1280, 390):
            await page.set_viewport_size({"width": width, "height": 900})
            await assert_chart_labels_whole(page, width)
        await page.set_viewport_size({"width": 1280, "height": 900})
        await review(page, "admin-billing")

        await page.goto(f"{url}/console/admin/fleet")
        engine = page.locator("[data-engine]")
        assert await engine.count() == 1
        assert await engine.locator('[data-fact="base-model"]').inner_text() == DEMO
        await review(page, "admin-fleet")
        problems.check()


async def test_csrf_field_is_on_every_admin_form(client: AsyncTestClient[Litestar]) -> None:
    await sign_in(client, ADMIN_TOKEN)
    tenant_id = await create_tenant(client, "acme")
    for path in ("/console/admin/tenants", f"/console/admin/tenants/{tenant_id}", "/console/admin/models"):
        text = (await client.get(path)).text
        forms = re.findall(r'<form method="post".*?</form>', text, flags=re.S)
        assert forms, path
        assert all(csrf_token(form) for form in forms), path
