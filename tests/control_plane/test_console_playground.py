"""The Playground (/console/playground) on the platform with the embedded demo engine (`loraplex-demo`), over a real
socket: Chromium chats with the base model and sees the reply stream in with its token counts, and the requests are
the API's (usage rows of the signed-in key); over HTTP, the chat path's CSRF check and its non-streamed answer."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from _support.console import BrowserProblems, chromium, page_token, review, sign_in
from litestar import Litestar
from sqlalchemy import select

from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.completions.calls import MAX_BODY_BYTES
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DEMO = "loraplex-demo"
# Longer than a few KV blocks (16 tokens each), so that a second chat with the same start finds it in the prefix
# cache; short enough that it and max_tokens fit the demo model's 256 positions.
SYSTEM_PROMPT = (
    "You are the loraplex demo assistant. Answer in one short sentence, politely, and never mention the weather, "
    "the time of day, or anything about yourself."
)
USAGE_LINE = re.compile(r"^([\d,]+) prompt tokens? · ([\d,]+) cached tokens? · ([\d,]+) completion tokens?$")


class Tenant:
    def __init__(self, tenant_id: str, key_id: str, key: str) -> None:
        self.id, self.key_id, self.key = tenant_id, key_id, key


async def make_tenant(url: str, name: str) -> Tenant:
    """A tenant and a key, through the admin API of the served platform."""
    async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
        response = await admin.post("/admin/tenants", json={"name": name})
        assert response.status_code == 201, response.text
        tenant = response.json()
        response = await admin.post(f"/admin/tenants/{tenant['id']}/api-keys", json={"name": "console"})
        assert response.status_code == 201, response.text
        created = response.json()
    return Tenant(tenant["id"], created["id"], created["key"])


async def usage_rows(url: str, tenant: Tenant) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}) as api:
        response = await api.get("/v1/usage", params={"limit": 100})
        assert response.status_code == 200, response.text
        rows: list[dict[str, Any]] = response.json()["data"]
        return rows


@pytest.fixture
async def signed_in(demo_platform: tuple[Litestar, str]) -> AsyncIterator[tuple[httpx.AsyncClient, Tenant]]:
    """A browser-like client of the demo platform, signed in as a new tenant."""
    _, url = demo_platform
    tenant = await make_tenant(url, f"playground-http-{uuid.uuid4().hex[:8]}")
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        assert (await sign_in(client, tenant.key)).status_code == 303
        yield client, tenant


async def test_the_chat_path_needs_the_csrf_header_and_answers_as_the_api(
    demo_platform: tuple[Litestar, str], signed_in: tuple[httpx.AsyncClient, Tenant]
) -> None:
    _, url = demo_platform
    client, tenant = signed_in
    body = {"model": DEMO, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
    refused = await client.post("/console/playground/chat", json=body)
    assert refused.status_code == 403
    assert "CSRF" in refused.text
    assert await usage_rows(url, tenant) == []

    token = await page_token(client, "/console/playground")
    answered = await client.post("/console/playground/chat", json=body, headers={"X-CSRF-Token": token})
    assert answered.status_code == 200, answered.text
    completion = answered.json()
    assert completion["object"] == "chat.completion" and completion["model"] == DEMO
    assert isinstance(completion["choices"][0]["message"]["content"], str)
    assert completion["usage"]["prompt_tokens"] > 0
    (row,) = await usage_rows(url, tenant)
    assert row["request_id"] == completion["id"] and row["model"] == DEMO

    # The API's own validation and errors, as JSON the script can show.
    invalid = await client.post(
        "/console/playground/chat", json={**body, "temperature": 5}, headers={"X-CSRF-Token": token}
    )
    assert invalid.status_code == 400
    assert "temperature" in invalid.json()["detail"]
    unknown = await client.post(
        "/console/playground/chat", json={**body, "model": "no-such-model"}, headers={"X-CSRF-Token": token}
    )
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["detail"]
    too_large = await client.post(
        "/console/playground/chat",
        content=b"{" + b" " * MAX_BODY_BYTES + b"}",
        headers={"X-CSRF-Token": token, "Content-Type": "application/json"},
    )
    assert too_large.status_code == 413 and too_large.json()["detail"]
    assert len(await usage_rows(url, tenant)) == 1


async def test_the_page_lists_the_models_and_preselects_the_one_asked_for(
    signed_in: tuple[httpx.AsyncClient, Tenant],
) -> None:
    client, tenant = signed_in
    created = await client.post(
        "/v1/endpoints",
        json={"name": "demo-bot", "base_model": DEMO},
        headers={"Authorization": f"Bearer {tenant.key}"},
    )
    assert created.status_code == 201, created.text
    page = (await client.get("/console/playground", params={"model": DEMO})).text
    assert '<optgroup label="Your endpoints">' in page and '<option value="demo-bot">demo-bot</option>' in page
    assert f'<option value="{DEMO}" selected>' in page
    page = (await client.get("/console/playground", params={"model": "demo-bot"})).text
    assert '<option value="demo-bot" selected>' in page and f'<option value="{DEMO}">' in page
    page = (await client.get("/console/playground", params={"model": "not-mine"})).text
    assert " selected>" not in page  # an unknown name selects nothing: the first model stays chosen


async def test_chromium_chats_with_the_demo_model(demo_platform: tuple[Litestar, str], demo_settings: Settings) -> None:
    _, url = demo_platform
    tenant = await make_tenant(url, "playground-browser")
    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        problems = BrowserProblems(page, url)
        await page.goto(f"{url}/console")
        await page.fill("#key", tenant.key)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{url}/console/playground")
        await page.select_option("#model", DEMO)
        await page.fill("#system", SYSTEM_PROMPT)

        async def send(text: str) -> tuple[int, int, int]:
            """Send `text`; wait for the reply to stream in and its usage line; the line's three counts."""
            replies = page.locator(".turn.assistant")
            count = await replies.count()
            await page.fill("#message", text)
            await page.click("#send")
            reply = replies.nth(count)
            await reply.locator(".text").filter(has_text=re.compile(r"\S")).wait_for(timeout=60_000)
            usage = reply.locator(".usage")
            await usage.wait_for(timeout=60_000)
            found = USAGE_LINE.match(await usage.inner_text())
            assert found is not None, await usage.inner_text()
            assert await reply.locator(".error").count() == 0
            prompt, cached, completion = (int(group.replace(",", "")) for group in found.groups())
            return prompt, cached, completion

        first = await send("Say hello to the new user.")
        assert first[0] > 0 and first[2] > 0
        assert await page.input_value("#message") == ""
        # The same chat carries the conversation: the second prompt holds the first exchange.
        follow_up = await send("And once more, please.")
        assert follow_up[0] > first[0] + first[2]
        await review(page, "playground")

        await page.click("#new-chat")
        assert await page.locator(".turn").count() == 0
        again = await send("Say hello to the new user.")
        assert again[0] == first[0]  # a new chat: only the system prompt and this message
        assert again[1] > 0  # its start was just computed for the first chat: the prefix cache has it
        problems.check()

    rows = await usage_rows(url, tenant)
    assert len(rows) == 3 and {row["model"] for row in rows} == {DEMO}
    assert sorted(row["prompt_tokens"] for row in rows) == sorted([first[0], follow_up[0], again[0]])
    # Recorded for the key the browser signed in with.
    engine = create_engine(demo_settings.effective_database_url)
    try:
        async with create_session_factory(engine)() as session:
            keys = (
                await session.scalars(
                    select(UsageRecord.api_key_id).where(UsageRecord.tenant_id == uuid.UUID(tenant.id))
                )
            ).all()
    finally:
        await engine.dispose()
    assert keys == [tenant.key_id] * 3
