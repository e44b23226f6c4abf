"""The request path's cached configuration (decision 0035): what a completion reads of keys, tenants, endpoints and
base models is served from the process's memory, and an admin or tenant write is seen by the next request, in this
process and (Postgres + Redis) in every other one.

With no engine running, a completion that gets past everything the cache feeds (the key, the model, the tenant's
terms) answers 503 engine_unavailable; the refusals before it say which cached value the request saw.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.app import create_app
from loraplex.platform.config_cache import GENERATION_KEY, ConfigCache, watch_sessions
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.kv import MemoryStore
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, migrate

Client = AsyncTestClient[Litestar]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- the cache itself ---------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DownStore(MemoryStore):
    async def get(self, key: str) -> bytes | None:
        raise RedisConnectionError("down")


class TestConfigCache:
    async def test_a_read_begun_before_a_change_is_not_stored(self) -> None:
        cache = ConfigCache(MemoryStore())
        table = cache.table()
        await cache.sync()
        fill = cache.fill()  # a request starts reading the database ...
        cache.invalidate()  # ... a change commits meanwhile ...
        table.put("k", "read before the change", fill)  # ... and what the request read must not be served
        assert table.get("k") is None
        fill = cache.fill()
        table.put("k", "read after it", fill)
        assert table.get("k") == "read after it"

    async def test_a_new_generation_in_the_store_empties_every_table_of_every_replica(self) -> None:
        shared = MemoryStore()
        one, two = ConfigCache(shared), ConfigCache(shared)
        tables = [two.table(), two.table()]
        await two.sync()
        for table in tables:
            table.put("k", "v", two.fill())
        await two.sync()  # nothing changed: still there
        assert [t.get("k") for t in tables] == ["v", "v"]
        await one.publish()  # another replica committed a change
        assert [t.get("k") for t in tables] == ["v", "v"]  # until this replica's next request ...
        await two.sync()
        assert [t.get("k") for t in tables] == [None, None]  # ... which finds them empty

    async def test_a_generation_lost_by_the_store_starts_a_new_one(self) -> None:
        store = MemoryStore()
        cache = ConfigCache(store)
        table = cache.table()
        await cache.sync()
        table.put("k", "v", cache.fill())
        await store.delete(GENERATION_KEY)  # Redis restarted, or evicted it
        await cache.sync()
        assert table.get("k") is None
        assert await store.get(GENERATION_KEY) is not None

    async def test_an_unreadable_store_serves_and_stores_nothing(self) -> None:
        cache = ConfigCache(DownStore())
        table = cache.table()
        await cache.sync()
        table.put("k", "v", cache.fill())
        assert table.get("k") is None

    async def test_entries_age_out(self) -> None:
        clock = FakeClock()
        cache = ConfigCache(MemoryStore(), max_age_s=10, clock=clock)
        table = cache.table()
        await cache.sync()
        table.put("k", "v", cache.fill())
        clock.now = 9.9
        assert table.get("k") == "v"
        clock.now = 10.0
        assert table.get("k") is None

    async def test_a_commit_that_changes_a_cached_kind_empties_the_tables_and_is_published(
        self, tmp_path: Path
    ) -> None:
        settings = Settings(data_dir=tmp_path)
        await migrate(settings)
        engine = create_engine(settings.effective_database_url)
        try:
            store = MemoryStore()
            cache, replica = ConfigCache(store), ConfigCache(store)
            sessions: async_sessionmaker[AsyncSession] = create_session_factory(engine)
            watch_sessions(sessions, cache)
            here, there = cache.table(), replica.table()
            for c, table in ((cache, here), (replica, there)):
                await c.sync()
                table.put("k", "v", c.fill())
            async with sessions() as session:
                session.add(Tenant(name="acme"))
                await session.commit()
                assert here.get("k") is None  # this process: at the commit
                await replica.sync()
                assert there.get("k") == "v"  # the others: once published ...
                await cache.publish_changes(session)
            await replica.sync()
            assert there.get("k") is None  # ... which the request's session does as it ends
            # A commit that changes no cached kind starts no generation.
            here.put("k", "v", cache.fill())
            async with sessions() as session:
                await session.commit()
                await cache.publish_changes(session)
            await cache.sync()
            assert here.get("k") == "v"
        finally:
            await engine.dispose()


# --- through the API: one process (embedded) and two sharing Postgres + Redis ------------------------------------


@pytest.fixture(params=["embedded", "services"])
async def deployment(
    request: pytest.FixtureRequest, tmp_path: Path, integration_settings: Settings
) -> AsyncIterator[tuple[Client, Client, Settings]]:
    """(writer, reader, settings): the same process in the embedded mode (SQLite, the in-process store); two
    processes' worth of app (their own pools, stores and caches) over one Postgres and one Redis otherwise."""
    if request.param == "embedded":
        (tmp_path / "embedded").mkdir()
        settings = Settings(data_dir=tmp_path / "embedded", admin_token=ADMIN_TOKEN, engine_mode="off")
        await migrate(settings)
        async with AsyncTestClient(app=create_app(settings)) as client:
            yield client, client, settings
        return
    await migrate(integration_settings)
    one, two = create_app(integration_settings), create_app(integration_settings)
    async with AsyncTestClient(app=one) as writer, AsyncTestClient(app=two) as reader:
        yield writer, reader, integration_settings


class Tenancy:
    """A base model, a tenant with a key, and an endpoint `bot` on the base model."""

    def __init__(self, writer: Client, reader: Client) -> None:
        self.writer, self.reader = writer, reader
        self.base = f"tiny-{secrets.token_hex(3)}"
        self.tenant_id = ""
        self.key = ""
        self.endpoint_id = ""

    async def create(self, checkpoint: Path) -> Tenancy:
        registered = await self.writer.post(
            "/admin/base-models", json={"name": self.base, "source": str(checkpoint)}, headers=ADMIN
        )
        assert registered.status_code == 201, registered.text
        tenant = await self.writer.post("/admin/tenants", json={"name": f"t-{secrets.token_hex(4)}"}, headers=ADMIN)
        self.tenant_id = tenant.json()["id"]
        key = await self.writer.post(f"/admin/tenants/{self.tenant_id}/api-keys", json={}, headers=ADMIN)
        self.key = key.json()["key"]
        endpoint = await self.writer.post(
            "/v1/endpoints", json={"name": "bot", "base_model": self.base}, headers=bearer(self.key)
        )
        assert endpoint.status_code == 201, endpoint.text
        self.endpoint_id = endpoint.json()["id"]
        return self

    async def complete(self, model: str = "bot", key: str | None = None, **fields: Any) -> tuple[int, str | None]:
        """(status, error code) of a one-token chat completion the reader is sent."""
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}
        response = await self.reader.post("/v1/chat/completions", json=body, headers=bearer(key or self.key))
        return response.status_code, response.json()["error"]["code"]


PAST_THE_CACHE = (503, "engine_unavailable")


@pytest.fixture
async def tenancy(deployment: tuple[Client, Client, Settings], tiny_base_checkpoint: Path) -> Tenancy:
    writer, reader, _ = deployment
    made = await Tenancy(writer, reader).create(tiny_base_checkpoint)
    assert await made.complete() == PAST_THE_CACHE  # the reader has cached all of it
    return made


class TestAWriteIsSeenByTheNextRequest:
    async def test_a_deleted_endpoint(self, tenancy: Tenancy) -> None:
        deleted = await tenancy.writer.delete(f"/v1/endpoints/{tenancy.endpoint_id}", headers=bearer(tenancy.key))
        assert deleted.status_code == 200
        assert await tenancy.complete() == (404, "model_not_found")

    async def test_a_new_endpoint(self, tenancy: Tenancy) -> None:
        assert await tenancy.complete("other") == (404, "model_not_found")
        made = await tenancy.writer.post(
            "/v1/endpoints", json={"name": "other", "base_model": tenancy.base}, headers=bearer(tenancy.key)
        )
        assert made.status_code == 201, made.text
        assert await tenancy.complete("other") == PAST_THE_CACHE

    async def test_the_tenants_terms(self, tenancy: Tenancy) -> None:
        assert await tenancy.complete(service_tier="priority") == (400, "service_tier_not_allowed")
        patched = await tenancy.writer.patch(
            f"/admin/tenants/{tenancy.tenant_id}", json={"service_tiers": ["default", "priority"]}, headers=ADMIN
        )
        assert patched.status_code == 200
        assert await tenancy.complete(service_tier="priority") == PAST_THE_CACHE

    async def test_a_revoked_key(self, tenancy: Tenancy) -> None:
        revoked = await tenancy.writer.delete(f"/admin/api-keys/{tenancy.key.split('_')[1]}", headers=ADMIN)
        assert revoked.status_code == 200
        assert await tenancy.complete() == (401, "invalid_api_key")

    async def test_a_suspended_tenant(self, tenancy: Tenancy) -> None:
        suspended = await tenancy.writer.patch(
            f"/admin/tenants/{tenancy.tenant_id}", json={"status": "suspended"}, headers=ADMIN
        )
        assert suspended.status_code == 200
        assert await tenancy.complete() == (401, "account_suspended")

    async def test_a_base_models_reasoning_config(self, tenancy: Tenancy) -> None:
        assert await tenancy.complete(thinking_token_budget=4) == (400, "unsupported_parameter")
        patched = await tenancy.writer.patch(
            f"/admin/base-models/{tenancy.base}", json={"reasoning_config": {"parser": "qwen3"}}, headers=ADMIN
        )
        assert patched.status_code == 200, patched.text
        assert await tenancy.complete(thinking_token_budget=4) == PAST_THE_CACHE


async def test_the_cache_serves_until_a_write_and_then_nothing_read_before_it(
    deployment: tuple[Client, Client, Settings], tiny_base_checkpoint: Path
) -> None:
    """A change made behind the platform's back (SQL by hand) is not seen while the cache holds the row, which shows
    the request read the cache; the next write through the platform, of anything cached, empties it all."""
    writer, reader, settings = deployment
    tenancy = await Tenancy(writer, reader).create(tiny_base_checkpoint)
    assert await tenancy.complete(service_tier="priority") == (400, "service_tier_not_allowed")
    engine = create_engine(settings.effective_database_url)
    try:
        async with create_session_factory(engine)() as session:  # not the platform's: nothing is published
            tenant = await session.get(Tenant, uuid.UUID(tenancy.tenant_id))
            assert tenant is not None
            tenant.service_tiers = ["default", "priority"]
            await session.commit()
    finally:
        await engine.dispose()
    assert await tenancy.complete(service_tier="priority") == (400, "service_tier_not_allowed")
    made = await writer.post("/v1/api-keys", json={}, headers=bearer(tenancy.key))  # a write of another row
    assert made.status_code == 201
    assert await tenancy.complete(service_tier="priority") == PAST_THE_CACHE
