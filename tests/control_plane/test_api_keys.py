"""API keys: shown once, stored as keyed hashes, cached in Redis, revocable everywhere within a second."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy import select

from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.api_keys.models import ApiKey
from loraplex.platform.settings import Settings

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id_of(key: str) -> str:
    return key.split("_")[1]


class TestCreateAndList:
    async def test_key_is_returned_once(self, client: Client, make_tenant: Any) -> None:
        _, key = await make_tenant("once")
        created = await client.post("/v1/api-keys", json={"name": "ci"}, headers=bearer(key))
        assert created.status_code == 201
        body = created.json()
        assert body["key"].startswith(f"lpx_{body['id']}_")
        assert body["prefix"] == f"lpx_{body['id']}"
        listed = (await client.get("/v1/api-keys", headers=bearer(key))).json()
        assert listed["object"] == "list"
        assert {k["id"] for k in listed["data"]} == {body["id"], key_id_of(key)}
        assert all("key" not in k for k in listed["data"])
        # The new key works on its own.
        assert (await client.get("/v1/me", headers=bearer(body["key"]))).status_code == 200

    async def test_stored_only_as_a_keyed_hash(
        self, client: Client, make_tenant: Any, integration_settings: Settings
    ) -> None:
        _, key = await make_tenant("hashed")
        # The app runs on the test client's own event loop: read the database through a connection of ours.
        engine = create_engine(integration_settings.effective_database_url)
        try:
            async with create_session_factory(engine)() as session:
                row = await session.scalar(select(ApiKey).where(ApiKey.id == key_id_of(key)))
        finally:
            await engine.dispose()
        assert row is not None
        secret = key.split("_")[2]
        assert secret not in row.key_hash
        assert integration_settings.secret_key is not None
        expected = hmac.new(
            integration_settings.secret_key.get_secret_value().encode(), key.encode(), hashlib.sha256
        ).hexdigest()
        assert row.key_hash == expected
        assert row.key_hash != hashlib.sha256(key.encode()).hexdigest()

    async def test_lookup_is_cached_in_redis(
        self, client: Client, make_tenant: Any, integration_settings: Settings
    ) -> None:
        _, key = await make_tenant("cached")
        assert (await client.get("/v1/me", headers=bearer(key))).status_code == 200
        assert integration_settings.redis_url is not None
        redis = Redis.from_url(integration_settings.redis_url)
        try:
            name = f"{integration_settings.redis_prefix}apikey:{key_id_of(key)}"
            raw = await redis.get(name)
            assert raw is not None
            assert key.split("_")[2].encode() not in raw
            ttl = await redis.pttl(name)
            assert 0 < ttl <= integration_settings.key_cache_ttl_s * 1000
        finally:
            await redis.aclose()


class TestRefusals:
    @pytest.mark.parametrize(
        "header",
        [
            None,
            "Bearer",
            "Basic abc",
            "Bearer sk-not-ours",
            "Bearer lpx_aaaaaaaaaaaaaaaa_" + "A" * 32,
        ],
    )
    async def test_missing_or_wrong_key(self, client: Client, header: str | None) -> None:
        headers = {"Authorization": header} if header else {}
        response = await client.get("/v1/me", headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"

    async def test_right_id_wrong_secret(self, client: Client, make_tenant: Any) -> None:
        _, key = await make_tenant("wrong-secret")
        forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert (await client.get("/v1/me", headers=bearer(key))).status_code == 200
        response = await client.get("/v1/me", headers=bearer(forged))
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


class TestRevoke:
    async def test_tenant_revokes_own_key(self, client: Client, make_tenant: Any) -> None:
        _, key = await make_tenant("revoker")
        other = (await client.post("/v1/api-keys", headers=bearer(key))).json()["key"]
        response = await client.delete(f"/v1/api-keys/{key_id_of(other)}", headers=bearer(key))
        assert response.status_code == 200
        assert response.json()["revoked_at"] is not None
        refused = await client.get("/v1/me", headers=bearer(other))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/me", headers=bearer(key))).status_code == 200
        again = await client.delete(f"/v1/api-keys/{key_id_of(other)}", headers=bearer(key))
        assert again.json()["revoked_at"] == response.json()["revoked_at"]

    async def test_admin_revokes_any_key(self, client: Client, make_tenant: Any, admin_headers: dict[str, str]) -> None:
        _, key = await make_tenant("admin-revoked")
        response = await client.delete(f"/admin/api-keys/{key_id_of(key)}", headers=admin_headers)
        assert response.status_code == 200
        assert (await client.get("/v1/me", headers=bearer(key))).status_code == 401

    async def test_unknown_key(self, client: Client, make_tenant: Any, admin_headers: dict[str, str]) -> None:
        _, key = await make_tenant("unknown-key")
        assert (await client.delete("/v1/api-keys/nosuchkey", headers=bearer(key))).status_code == 404
        assert (await client.delete("/admin/api-keys/nosuchkey", headers=admin_headers)).status_code == 404


class TestTenantIsolation:
    async def test_other_tenants_keys_are_404(self, client: Client, make_tenant: Any) -> None:
        _, key_a = await make_tenant("tenant-a")
        _, key_b = await make_tenant("tenant-b")
        response = await client.delete(f"/v1/api-keys/{key_id_of(key_b)}", headers=bearer(key_a))
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
        assert (await client.get("/v1/me", headers=bearer(key_b))).status_code == 200
        listed = (await client.get("/v1/api-keys", headers=bearer(key_a))).json()
        assert [k["id"] for k in listed["data"]] == [key_id_of(key_a)]
        # A cursor naming another tenant's key reveals nothing.
        page = await client.get(f"/v1/api-keys?after={key_id_of(key_b)}", headers=bearer(key_a))
        assert page.json()["data"] == []


@pytest.fixture
async def replicas(app: Litestar, integration_settings: Settings) -> AsyncIterator[tuple[Client, Client]]:
    """Two platform processes' worth of state (own pools, own Redis clients) over the same services."""
    second = create_app(integration_settings)
    async with AsyncTestClient(app=app) as one, AsyncTestClient(app=second) as two:
        yield one, two


async def _refused_within(client: Client, key: str, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if (await client.get("/v1/me", headers=bearer(key))).status_code == 401:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"key still accepted {seconds} s after the change")


class TestEveryReplica:
    async def _tenant(self, client: Client, admin_headers: dict[str, str], name: str) -> tuple[str, str]:
        tenant = (await client.post("/admin/tenants", json={"name": name}, headers=admin_headers)).json()
        created = await client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin_headers)
        return tenant["id"], created.json()["key"]

    async def test_revocation_reaches_every_replica(
        self, replicas: tuple[Client, Client], admin_headers: dict[str, str]
    ) -> None:
        one, two = replicas
        _, key = await self._tenant(one, admin_headers, "replicated-revoke")
        # Both replicas have used (and cached) the key.
        assert (await one.get("/v1/me", headers=bearer(key))).status_code == 200
        assert (await two.get("/v1/me", headers=bearer(key))).status_code == 200
        assert (await one.delete(f"/v1/api-keys/{key_id_of(key)}", headers=bearer(key))).status_code == 200
        assert await _refused_within(two, key, 1.0) < 1.0

    async def test_suspension_reaches_every_replica(
        self, replicas: tuple[Client, Client], admin_headers: dict[str, str]
    ) -> None:
        one, two = replicas
        tenant_id, key = await self._tenant(one, admin_headers, "replicated-suspend")
        assert (await two.get("/v1/me", headers=bearer(key))).status_code == 200
        await one.patch(f"/admin/tenants/{tenant_id}", json={"status": "suspended"}, headers=admin_headers)
        assert await _refused_within(two, key, 1.0) < 1.0
        await one.patch(f"/admin/tenants/{tenant_id}", json={"status": "active"}, headers=admin_headers)
        assert (await two.get("/v1/me", headers=bearer(key))).status_code == 200
