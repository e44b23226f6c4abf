"""Console sign-in and sessions over HTTP, on real Postgres and Redis: cookies, CSRF, the sign-in throttle, and
sessions that end with sign-out, a revoked key, a suspended tenant or a changed admin token."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from _support.console import csrf_token, other_browser, page_token, sign_in
from litestar import Litestar
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy import update

from loraplex.platform.app import create_app
from loraplex.platform.console.security import CONTENT_SECURITY_POLICY
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.api_keys.keys import KeyHasher
from loraplex.platform.domain.api_keys.models import AdminKey
from loraplex.platform.domain.api_keys.service import ApiKeyService
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, SECRET_KEY, migrate

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(autouse=True)
def _no_redirects(client: AsyncTestClient[Litestar]) -> None:
    """Redirects are what these tests look at (a browser follows them; the assertions read them)."""
    client.follow_redirects = False


def set_cookie_headers(response: Any) -> list[str]:
    return [value for name, value in response.headers.multi_items() if name.lower() == "set-cookie"]


async def test_console_shows_the_sign_in_form_with_the_console_headers(client: AsyncTestClient[Litestar]) -> None:
    response = await client.get("/console")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-frame-options"] == "DENY"
    assert 'action="/console/sign-in"' in response.text
    assert "<script>" not in response.text  # scripts come from files only
    (cookie,) = set_cookie_headers(response)
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()


async def test_a_tenant_signs_in_and_gets_an_opaque_http_only_strict_cookie(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], redis_server: Any, redis_prefix: str
) -> None:
    _, key = await make_tenant("acme")
    response = await sign_in(client, key)
    assert response.status_code == 303
    assert response.headers["location"] == "/console/playground"
    session_cookie = next(c for c in set_cookie_headers(response) if c.startswith("lpx_console="))
    attributes = session_cookie.lower()
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/" in attributes
    assert "secure" not in attributes  # this platform's public URL is not https
    session_id = session_cookie.split(";")[0].split("=", 1)[1]
    assert key not in session_cookie and len(session_id) >= 40
    # The store keeps the session under a hash of the id, never the id (or the key) itself.
    redis = Redis.from_url(redis_server.url)
    try:
        names = [name.decode() async for name in redis.scan_iter(f"{redis_prefix}console:session:*")]
        assert names == [f"{redis_prefix}console:session:{hashlib.sha256(session_id.encode()).hexdigest()}"]
        stored = await redis.get(names[0])
        assert stored is not None and key.encode() not in stored and session_id.encode() not in stored
        assert 0 < await redis.ttl(names[0]) <= 8 * 3600
    finally:
        await redis.aclose()
    page = await client.get("/console/keys")
    assert page.status_code == 200
    assert key not in page.text  # a key never shows again after its creation


async def test_a_wrong_key_is_refused_with_one_message_and_is_not_echoed(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    _, key = await make_tenant("acme")
    wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")
    for attempt in (wrong, "lpxadm_" + key[4:], "not a key at all"):
        response = await sign_in(client, attempt)
        assert response.status_code == 401
        assert "That key was not accepted" in response.text
        assert attempt not in response.text
        assert "lpx_console=" not in " ".join(set_cookie_headers(response))


async def test_sign_in_without_the_form_token_is_refused(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    _, key = await make_tenant("acme")
    await client.get("/console")
    response = await client.post("/console/sign-in", data={"key": key})
    assert response.status_code == 403
    response = await client.post("/console/sign-in", data={"key": key, "csrf_token": "forged"})
    assert response.status_code == 403
    assert (await client.get("/console/keys")).status_code == 303  # no session was opened


async def test_a_form_without_the_csrf_token_is_refused(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    _, key = await make_tenant("acme")
    assert (await sign_in(client, key)).status_code == 303
    before = (await client.get("/v1/api-keys", headers={"Authorization": f"Bearer {key}"})).json()["data"]
    for data in ({"name": "x"}, {"name": "x", "csrf_token": "forged"}):
        response = await client.post("/console/keys", data=data)
        assert response.status_code == 403
        assert "CSRF" in response.text
        assert response.headers["content-type"].startswith("text/html")
    response = await client.post("/console/keys", data={"name": "x"}, headers={"X-CSRF-Token": "forged"})
    assert response.status_code == 403
    after = (await client.get("/v1/api-keys", headers={"Authorization": f"Bearer {key}"})).json()["data"]
    assert after == before  # nothing was created
    token = await page_token(client, "/console/keys")
    response = await client.post("/console/keys", data={"name": "ci", "csrf_token": token})
    assert response.status_code == 201
    assert "lpx_" in response.text and "data-created-key" in response.text


async def test_signing_out_ends_the_session_for_the_old_cookie_too(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], app: Litestar
) -> None:
    _, key = await make_tenant("acme")
    assert (await sign_in(client, key)).status_code == 303
    old_cookie = client.cookies.get("lpx_console")
    assert old_cookie
    token = await page_token(client, "/console/keys")
    response = await client.post("/console/sign-out", data={"csrf_token": token})
    assert response.status_code == 303 and response.headers["location"] == "/console"
    assert (await client.get("/console/keys")).status_code == 303
    # The cookie put back by hand (a copy of it, a stolen one) opens nothing either.
    with other_browser(client) as other:
        other.cookies.set("lpx_console", old_cookie)
        response = await other.get("/console/keys")
        assert response.status_code == 303 and response.headers["location"] == "/console?next=%2Fconsole%2Fkeys"


async def test_revoking_the_key_or_suspending_the_tenant_ends_its_sessions(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], app: Litestar
) -> None:
    tenant, key = await make_tenant("acme")
    assert (await sign_in(client, key)).status_code == 303
    assert (await client.get("/console/keys")).status_code == 200
    key_id = key.split("_")[1]
    assert (await client.delete(f"/admin/api-keys/{key_id}", headers=ADMIN)).status_code == 200
    assert (await client.get("/console/keys")).status_code == 303

    response = await client.post(f"/admin/tenants/{tenant['id']}/api-keys", json={}, headers=ADMIN)
    second = response.json()["key"]
    with other_browser(client) as second_browser:
        assert (await sign_in(second_browser, second)).status_code == 303
        assert (await second_browser.get("/console/keys")).status_code == 200
        response = await client.patch(f"/admin/tenants/{tenant['id']}", json={"status": "suspended"}, headers=ADMIN)
        assert response.status_code == 200
        assert (await second_browser.get("/console/keys")).status_code == 303
        # A suspended tenant cannot sign in again either.
        assert (await sign_in(second_browser, second)).status_code == 401


async def test_admins_sign_in_with_the_token_or_an_admin_key_and_tenants_cannot_open_admin_pages(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], integration_settings: Settings
) -> None:
    response = await sign_in(client, ADMIN_TOKEN)
    assert response.status_code == 303 and response.headers["location"] == "/console/admin/tenants"
    assert (await client.get("/console/admin/tenants")).status_code == 200
    assert (await client.get("/console/keys")).status_code == 403  # admins have no tenant pages
    # An admin key as `loraplex admin create-key` makes one, then revoked in the database.
    engine = create_engine(integration_settings.effective_database_url)
    try:
        sessions = create_session_factory(engine)
        async with sessions() as session:
            row, admin_key = await ApiKeyService(session, KeyHasher(SECRET_KEY.encode())).create_admin_key(name="ops")
            await session.commit()
        with other_browser(client) as second_browser:
            assert (await sign_in(second_browser, admin_key.full_key)).status_code == 303
            assert (await second_browser.get("/console/admin/fleet")).status_code == 200
            async with sessions() as session:
                revoke = update(AdminKey).where(AdminKey.id == row.id).values(revoked_at=datetime.now(UTC))
                await session.execute(revoke)
                await session.commit()
            assert (await second_browser.get("/console/admin/fleet")).status_code == 303
    finally:
        await engine.dispose()

    _, key = await make_tenant("acme")
    with other_browser(client) as second_browser:
        assert (await sign_in(second_browser, key)).status_code == 303
        for page in ("tenants", "models", "billing", "fleet"):
            path = f"/console/admin/{page}"
            response = await second_browser.get(path)
            assert response.status_code == 403, path
            assert "for admins" in response.text
        # A console session is not an API credential: the bearer APIs are unchanged.
        assert (await second_browser.get("/admin/tenants")).status_code == 401
        assert (await second_browser.get("/v1/models")).status_code == 401


async def test_sign_in_attempts_are_rate_limited_per_client(
    integration_settings: Settings, make_tenant: Callable[[str], Any]
) -> None:
    settings = integration_settings.model_copy(update={"console_sign_in_attempts_per_minute": 3})
    await migrate(settings)
    async with AsyncTestClient(app=create_app(settings)) as second_browser:
        answers = [await second_browser.get("/console")]
        for _ in range(4):  # each answer is a new form with a new token, as a browser would post it again
            token = csrf_token(answers[-1].text)
            answers.append(await second_browser.post("/console/sign-in", data={"key": "wrong", "csrf_token": token}))
        answers = answers[1:]
        assert [a.status_code for a in answers[:3]] == [401, 401, 401]
        assert answers[3].status_code == 429
        assert 1 <= int(answers[3].headers["retry-after"]) <= 60
        assert "Too many sign-in attempts" in answers[3].text


async def test_keys_never_reach_the_logs(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    _, key = await make_tenant("acme")
    with caplog.at_level(logging.DEBUG):
        await sign_in(client, key)
        token = await page_token(client, "/console/keys")
        created = await client.post("/console/keys", data={"name": "ci", "csrf_token": token})
        with other_browser(client) as other:
            await sign_in(other, key[:-1] + "x")
    assert created.status_code == 201
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert key not in logged and ADMIN_TOKEN not in logged


@pytest.fixture
async def https_client(integration_settings: Settings) -> AsyncIterator[AsyncTestClient[Litestar]]:
    settings = integration_settings.model_copy(update={"public_url": "https://console.example.com"})
    await migrate(settings)
    async with AsyncTestClient(app=create_app(settings), base_url="https://testserver.local") as value:
        value.follow_redirects = False
        yield value


async def test_cookies_are_secure_and_host_prefixed_behind_https(
    https_client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    _, key = await make_tenant("acme")
    response = await sign_in(https_client, key)
    assert response.status_code == 303
    cookie = next(c for c in set_cookie_headers(response) if c.startswith("__Host-lpx_console="))
    assert "secure" in cookie.lower() and "httponly" in cookie.lower() and "domain" not in cookie.lower()
    assert (await https_client.get("/console/keys")).status_code == 200


async def test_a_browser_sent_to_sign_in_comes_back_to_the_page_it_asked_for(
    client: AsyncTestClient[Litestar],
) -> None:
    html = {"Accept": "text/html,application/xhtml+xml"}
    # The billing page, pasted into a browser: no bearer token, so it opens in the console, which signs in first.
    response = await client.get("/admin/billing?start=2026-01-01", headers=html)
    assert response.status_code == 303
    assert response.headers["location"] == "/console/admin/billing?start=2026-01-01"
    response = await client.get(response.headers["location"], headers=html)
    assert response.status_code == 303
    assert response.headers["location"] == "/console?next=%2Fconsole%2Fadmin%2Fbilling%3Fstart%3D2026-01-01"
    form = await client.get(response.headers["location"])
    assert 'name="next" value="/console/admin/billing?start=2026-01-01"' in form.text
    response = await client.post(
        "/console/sign-in",
        data={
            "key": ADMIN_TOKEN,
            "csrf_token": csrf_token(form.text),
            "next": "/console/admin/billing?start=2026-01-01",
        },
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/console/admin/billing?start=2026-01-01"
    # API clients keep their 401 (no Accept: text/html), and the bearer token still opens the page itself.
    assert (await client.get("/admin/billing")).status_code == 401
    assert (await client.get("/admin/billing", headers={**html, **ADMIN})).status_code == 200


@pytest.mark.parametrize("wanted", ["https://evil.example/", "//evil.example/console/", "/console/admin/tenants"])
async def test_sign_in_never_leads_off_the_console_or_to_the_other_kind_of_page(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any], wanted: str
) -> None:
    _, key = await make_tenant("acme")
    form = await client.get("/console", params={"next": wanted})
    response = await client.post(
        "/console/sign-in", data={"key": key, "csrf_token": csrf_token(form.text), "next": wanted}
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/console/playground"


async def test_a_tenant_cannot_touch_another_tenants_key(
    client: AsyncTestClient[Litestar], make_tenant: Callable[[str], Any]
) -> None:
    _, key = await make_tenant("acme")
    _, other_key = await make_tenant("globex")
    other_id = other_key.split("_")[1]
    assert (await sign_in(client, key)).status_code == 303
    token = await page_token(client, "/console/keys")
    response = await client.post(f"/console/keys/{other_id}/revoke", data={"csrf_token": token})
    assert response.status_code == 404
    assert other_id not in (await client.get("/console/keys")).text
    # globex's key still works.
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {other_key}"})).status_code == 200
