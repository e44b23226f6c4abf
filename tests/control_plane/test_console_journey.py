"""A tenant's whole first visit to the console, in headless Chromium, on the platform `make dev` runs (the embedded
engine on the demo model, here on real Postgres, Redis and S3): sign in with a key, upload demo/adapters/upper
through the form (with JavaScript: progress, then the validation result), make an endpoint on it, chat with it in
the playground (streamed, in upper case, with its usage), make a key and revoke it, sign out, and find the old
cookie opens nothing. Each page is checked at 1280 and 390 px and screenshotted (build/test-output/console/).

The pages' finer behaviour is in the other test_console_* modules; this one is the path a new user walks.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from _support.console import BrowserProblems, chromium, review
from litestar import Litestar

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE

from .conftest import ADMIN_TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DEMO_BASE = "loraplex-demo"
DEMO_ADAPTER = Path(__file__).resolve().parents[2] / "demo" / "adapters" / "upper"
USAGE_LINE = re.compile(r"^([\d,]+) prompt tokens? · ([\d,]+) cached tokens? · ([\d,]+) completion tokens?$")


async def test_a_tenants_first_visit(demo_platform: tuple[Litestar, str]) -> None:
    _, url = demo_platform
    async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
        tenant = (await admin.post("/admin/tenants", json={"name": "journey"})).json()
        response = await admin.post(f"/admin/tenants/{tenant['id']}/api-keys", json={"name": "first"})
        key = response.json()["key"]
        # Another tenant, with an endpoint this one must never reach.
        other = (await admin.post("/admin/tenants", json={"name": "neighbour"})).json()
        other_key = (await admin.post(f"/admin/tenants/{other['id']}/api-keys", json={})).json()["key"]
        response = await admin.post(
            "/v1/endpoints",
            json={"name": "private", "base_model": DEMO_BASE, "adapter_id": None},
            headers={"Authorization": f"Bearer {other_key}"},
        )
        assert response.status_code == 201, response.text
        other_endpoint = response.json()

    async with chromium() as browser:
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        page = await context.new_page()
        problems = BrowserProblems(page, url)

        # Sign in: the address `make dev` prints is the form.
        await page.goto(f"{url}/console")
        await review(page, "sign-in")
        await page.fill("#key", key)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{url}/console/playground")
        cookies = await context.cookies()
        (session,) = [c for c in cookies if c["name"] == "lpx_console"]
        assert session["httpOnly"] and session["sameSite"] == "Strict"
        assert key not in session["value"]

        # Upload the demo adapter through the form; the script shows progress, then the validation result.
        await page.click("nav >> text=Adapters")
        await page.fill("#adapter-name", "upper")
        await page.select_option("#adapter-base", DEMO_BASE)
        await page.set_input_files("#adapter-config", DEMO_ADAPTER / CONFIG_FILE)
        await page.set_input_files("#adapter-weights", DEMO_ADAPTER / WEIGHTS_FILE)
        await page.click("form[data-upload] button[type=submit]")
        result = page.locator("[data-result]")
        await result.wait_for(state="visible")
        assert await page.locator("[data-progress] progress").get_attribute("value") == "100"
        assert re.fullmatch(r"Uploaded upper v1: ready, rank 8, [\d.]+ KiB\.", await result.inner_text())
        row = page.locator("table[data-table=adapters] tbody tr")
        await row.first.wait_for()
        assert await row.count() == 1
        assert "ready" in await row.inner_text()
        assert await page.locator("#adapter-name").input_value() == ""  # the form is ready for the next one
        await review(page, "adapters")

        # An endpoint on it, then its "try it" link to the playground.
        await page.click("nav >> text=Endpoints")
        await page.fill("#endpoint-name", "shouty")
        await page.select_option("#endpoint-base", DEMO_BASE)
        await page.select_option("#endpoint-adapter", label="upper v1")
        await page.click("form[action='/console/endpoints'] button[type=submit]")
        await page.locator("[data-created]").wait_for()
        row = page.locator("table[data-table=endpoints] tbody tr")
        text = await row.inner_text()
        assert "shouty" in text and "upper v1" in text and 'model="shouty"' in text
        await review(page, "endpoints")
        await page.click("table[data-table=endpoints] a[href*='playground']")
        await page.wait_for_url(f"{url}/console/playground?model=shouty")
        assert await page.locator("#model").input_value() == "shouty"

        # Chat: the answer streams in, in upper case (the adapter's doing), then its usage.
        await page.fill("#message", 'Tell me about the "for" statement.')
        await page.click("#send")
        reply = page.locator(".turn.assistant").last
        await reply.locator(".usage").wait_for(timeout=60_000)
        answer = await reply.locator(".text").inner_text()
        letters = [c for c in answer if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.8, answer
        found = USAGE_LINE.fullmatch((await reply.locator(".usage").inner_text()).strip())
        assert found is not None
        assert int(found.group(1).replace(",", "")) > 0 and int(found.group(3).replace(",", "")) > 0

        # A new key: shown once, with a copy button; then revoked.
        await page.click("nav >> text=API keys")
        await page.fill("#key-name", "laptop")
        await page.click("form[action='/console/keys'] button[type=submit]")
        new_key = (await page.locator("#new-key").inner_text()).strip()
        assert new_key.startswith("lpx_")
        assert await page.locator("button[data-copy=new-key]").is_visible()
        await review(page, "keys")
        await page.click("nav >> text=API keys")  # the page again: the key is not on it any more
        assert new_key not in await page.content()
        new_row = page.locator("tr", has_text="laptop")
        await new_row.locator("button", has_text="Revoke").click()
        await page.wait_for_url(f"{url}/console/keys")
        assert "revoked" in await page.locator("tr", has_text="laptop").inner_text()
        async with httpx.AsyncClient(base_url=url) as api:
            response = await api.get("/v1/models", headers={"Authorization": f"Bearer {new_key}"})
            assert response.status_code == 401

        # The chat was billed like any API request.
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as api:
            rows = (await api.get("/v1/usage")).json()["data"]
        assert [row["model"] for row in rows] == ["shouty"]

        # What this session may not do, tried from a second tab (its refusals are meant to show as errors):
        # open an admin page, touch another tenant's endpoint, or post without the CSRF token.
        probe = await context.new_page()
        answer = await probe.goto(f"{url}/console/admin/tenants")
        assert answer is not None
        assert answer.status == 403
        assert "This page is for admins." in await probe.content()
        await probe.goto(f"{url}/console/keys")
        statuses = await probe.evaluate(
            """async (other) => {
                const token = document.querySelector('meta[name="csrf-token"]').content;
                const form = {"Content-Type": "application/x-www-form-urlencoded"};
                const stolen = await fetch(`/console/endpoints/${other}/delete`,
                    {method: "POST", headers: {...form, "X-CSRF-Token": token}, body: ""});
                const forged = await fetch("/console/keys", {method: "POST", headers: form, body: "name=x"});
                return [stolen.status, forged.status];
            }""",
            other_endpoint["id"],
        )
        assert statuses == [404, 403]
        await probe.close()

        # Sign out; the old cookie, put back, opens nothing.
        await page.locator("header button", has_text="Sign out").click()
        await page.wait_for_url(f"{url}/console")
        await context.add_cookies([session])
        await page.goto(f"{url}/console/keys")
        assert page.url.startswith(f"{url}/console?next=")
        assert await page.locator("#key").is_visible()
        problems.check()
