"""Usage: one row per request, never two; kept in an outbox while the database is down and drained later; and
GET /v1/usage showing a tenant its own requests and totals."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from _support.waiting import wait_for_async
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.domain.usage.recorder import (
    DEAD_LETTER_KEY,
    OUTBOX_KEY,
    MemoryOutbox,
    RedisOutbox,
    UsageEvent,
    UsageRecorder,
    open_usage_recorder,
)
from loraplex.platform.ids import TenantId
from loraplex.platform.kv import MemoryStore, RedisStore
from loraplex.platform.settings import Settings

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
DEAD_DATABASE = "postgresql+asyncpg://nobody@127.0.0.1:1/x"  # port 1: every connection is refused at once
DEAD_REDIS = "redis://127.0.0.1:1/0"
NOW = datetime.now(UTC)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def migrate(settings: Settings) -> None:
    engine = create_engine(settings.effective_database_url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()


def event(tenant_id: uuid.UUID, request_id: str | None = None, **changes: Any) -> UsageEvent:
    base = UsageEvent(
        request_id=request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}",
        tenant_id=TenantId(tenant_id),
        api_key_id="k" * 16,
        endpoint_id=uuid.uuid4(),
        adapter_id=uuid.uuid4(),
        adapter_digest="sha256:" + "ab" * 32,
        model="support-bot",
        base_model="demo-llama",
        prompt_tokens=100,
        cached_tokens=40,
        completion_tokens=20,
        reasoning_tokens=8,  # of the 20: every recorder path must carry them
        status="ok",
        started_at=NOW - timedelta(minutes=5),
        finished_at=NOW - timedelta(minutes=4),
    )
    return replace(base, **changes)


@pytest.fixture
async def sessions(integration_settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on this test's migrated Postgres database."""
    await migrate(integration_settings)
    engine = create_engine(integration_settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def dead_sessions() -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(DEAD_DATABASE)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def store(integration_settings: Settings) -> AsyncIterator[RedisStore]:
    assert integration_settings.redis_url is not None
    kv = RedisStore(integration_settings.redis_url, prefix=integration_settings.redis_prefix)
    try:
        yield kv
    finally:
        await kv.close()


@pytest.fixture
async def tenant_ids(sessions: async_sessionmaker[AsyncSession]) -> list[uuid.UUID]:
    async with sessions() as session:
        tenants = [Tenant(name=f"tenant-{i}") for i in range(2)]
        session.add_all(tenants)
        await session.commit()
        return [t.id for t in tenants]


async def rows(sessions: async_sessionmaker[AsyncSession]) -> list[UsageRecord]:
    async with sessions() as session:
        return list((await session.scalars(select(UsageRecord).order_by(UsageRecord.request_id))).all())


async def _none_in_flight(recorder: UsageRecorder) -> bool:
    return recorder.num_in_flight == 0


async def count(sessions: async_sessionmaker[AsyncSession]) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(UsageRecord)) or 0)


class TestRecord:
    async def test_writes_one_row_with_every_field(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        recorder = open_usage_recorder(sessions, store)
        sent = event(tenant_ids[0])
        await recorder.record(sent)
        [row] = await rows(sessions)
        for name, value in sent.row().items():
            assert getattr(row, name) == value, name
        assert recorder.num_deferred == 0

    async def test_the_same_request_twice_counts_once(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        recorder = open_usage_recorder(sessions, store)
        first = event(tenant_ids[0], "chatcmpl-replayed")
        await recorder.record(first)
        await recorder.record(replace(first, completion_tokens=999))  # a retry must not overwrite or add
        [row] = await rows(sessions)
        assert row.completion_tokens == first.completion_tokens
        assert recorder.num_deferred == 0

    async def test_a_cancelled_caller_still_records_when_shielded(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        recorder = open_usage_recorder(sessions, store)
        started = asyncio.Event()

        async def request_handler() -> None:
            try:
                started.set()
                await asyncio.sleep(3600)  # streaming to a client that goes away
            finally:
                await asyncio.shield(recorder.record(event(tenant_ids[0], "chatcmpl-disconnected")))

        task = asyncio.create_task(request_handler())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await recorder.close()  # waits for the shielded write, as the app's shutdown does
        assert [r.request_id for r in await rows(sessions)] == ["chatcmpl-disconnected"]

    async def test_record_soon_writes_what_was_given_meanwhile_in_one_statement(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        recorder = open_usage_recorder(sessions, store)
        statements: list[int] = []
        insert = recorder._insert

        async def counted(batch: list[dict[str, Any]]) -> int:
            statements.append(len(batch))
            return await insert(batch)

        recorder._insert = counted  # type: ignore[method-assign]
        sent = [event(tenant_ids[i % 2]) for i in range(5)]
        for one in sent:
            recorder.record_soon(one)
        assert recorder.num_in_flight == 5
        await wait_for_async(lambda: _none_in_flight(recorder), 5, what="the queued events to be written")
        assert statements == [5]
        assert {r.request_id for r in await rows(sessions)} == {e.request_id for e in sent}
        assert recorder.num_deferred == 0

    async def test_a_batch_the_database_refuses_keeps_its_good_rows(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        """One row refused for good (its tenant deleted since) must neither sink the rows queued with it nor be lost."""
        recorder = open_usage_recorder(sessions, store)
        good = [event(tenant_ids[0]), event(tenant_ids[1])]
        orphan = event(uuid.uuid4())
        for one in (good[0], orphan, good[1]):
            recorder.record_soon(one)
        await wait_for_async(lambda: _none_in_flight(recorder), 5, what="the queued events to be written")
        assert {r.request_id for r in await rows(sessions)} == {e.request_id for e in good}
        assert recorder.num_deferred == 1
        [(_, fields)] = await store.redis.xrange(store.key(OUTBOX_KEY))
        assert fields[b"event"] == orphan.encode()

    async def test_close_writes_what_record_soon_was_given(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        recorder = UsageRecorder(sessions, [RedisOutbox(store)], linger_s=3600)  # the writer would wait an hour
        sent = event(tenant_ids[0])
        recorder.record_soon(sent)
        await recorder.close(timeout_s=0.5)
        # Not written by then: deferred, and the last drain of close moved it into the database.
        assert [r.request_id for r in await rows(sessions)] == [sent.request_id]

    def test_events_are_checked_where_they_are_made(self) -> None:
        tenant_id = uuid.uuid4()
        with pytest.raises(ValueError, match="timezone"):
            event(tenant_id, started_at=datetime(2024, 5, 1))
        with pytest.raises(ValueError, match="request_id"):
            event(tenant_id, "x" * 65)
        with pytest.raises(ValueError, match="token counts"):
            event(tenant_id, prompt_tokens=-1)
        with pytest.raises(ValueError, match="service_tier"):
            event(tenant_id, service_tier="auto")  # resolved before it is recorded: auto is default
        with pytest.raises(ValueError, match="token counts"):
            event(tenant_id, reasoning_tokens=-1)
        with pytest.raises(ValueError, match="at most completion_tokens"):
            event(tenant_id, completion_tokens=5, reasoning_tokens=6)  # reasoning tokens are completion tokens

    def test_an_outbox_entry_from_before_reasoning_tokens_decodes_with_none(self) -> None:
        sent = event(uuid.uuid4())
        assert UsageEvent.decode(sent.encode()).reasoning_tokens == 8
        older = json.loads(sent.encode())
        del older["reasoning_tokens"]  # deferred by a replica that knew no reasoning tokens
        assert UsageEvent.decode(json.dumps(older).encode()) == replace(sent, reasoning_tokens=0)

    def test_an_outbox_entry_from_before_service_tiers_decodes_on_the_default_tier(self) -> None:
        sent = event(uuid.uuid4(), service_tier="flex")
        assert UsageEvent.decode(sent.encode()) == sent
        # Deferred by a replica of the previous version, which knew no tiers: still billable, on default.
        older = json.loads(sent.encode())
        del older["service_tier"]
        assert UsageEvent.decode(json.dumps(older).encode()) == replace(sent, service_tier="default")
        # But a required field missing, or one no version ever wrote, is not an event.
        for broken in ({k: v for k, v in older.items() if k != "model"}, {**older, "priority": 0}):
            with pytest.raises(ValueError, match="not a usage event"):
                UsageEvent.decode(json.dumps(broken).encode())


class TestOutbox:
    async def test_database_down_goes_to_the_redis_stream_and_drains_exactly_once(
        self,
        sessions: async_sessionmaker[AsyncSession],
        dead_sessions: async_sessionmaker[AsyncSession],
        store: RedisStore,
        tenant_ids: list[uuid.UUID],
    ) -> None:
        down = open_usage_recorder(dead_sessions, store)
        sent = event(tenant_ids[0])
        await down.record(sent)  # must not raise
        assert down.num_deferred == 1
        assert await store.redis.xlen(store.key(OUTBOX_KEY)) == 1
        assert await count(sessions) == 0
        # While the database stays down, draining keeps the entry.
        assert await down.drain_once() == 0
        assert await store.redis.xlen(store.key(OUTBOX_KEY)) == 1

        up = open_usage_recorder(sessions, store)  # another replica, or the same one after the database is back
        assert await up.drain_once() == 1
        assert await up.drain_once() == 0
        assert await store.redis.xlen(store.key(OUTBOX_KEY)) == 0
        [row] = await rows(sessions)
        assert row.request_id == sent.request_id
        assert row.started_at == sent.started_at
        assert (row.completion_tokens, row.reasoning_tokens) == (20, 8)

    async def test_an_entry_already_in_the_database_is_not_counted_again(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        # A write that timed out on our side but committed on the database's lands in both places.
        sent = event(tenant_ids[0])
        recorder = open_usage_recorder(sessions, store)
        await recorder.record(sent)
        await RedisOutbox(store).append(sent.encode())
        assert await recorder.drain_once() == 0
        assert await count(sessions) == 1
        assert await store.redis.xlen(store.key(OUTBOX_KEY)) == 0

    async def test_a_partly_bad_batch_keeps_the_good_rows(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        outbox = RedisOutbox(store)
        good = [event(tenant_ids[0]), event(tenant_ids[1])]
        orphan = event(uuid.uuid4())  # its tenant does not exist (deleted since): the database refuses it for good
        await outbox.append(good[0].encode())
        await outbox.append(orphan.encode())
        await outbox.append(b"not an event")
        await outbox.append(good[1].encode())
        recorder = open_usage_recorder(sessions, store)
        assert await recorder.drain_once() == 2
        assert {r.request_id for r in await rows(sessions)} == {e.request_id for e in good}
        assert await store.redis.xlen(store.key(OUTBOX_KEY)) == 0
        dead = await store.redis.xrange(store.key(DEAD_LETTER_KEY))
        assert sorted(fields[b"event"] for _, fields in dead) == sorted([orphan.encode(), b"not an event"])
        assert await recorder.drain_once() == 0

    async def test_redis_down_too_falls_back_to_process_memory(
        self,
        sessions: async_sessionmaker[AsyncSession],
        dead_sessions: async_sessionmaker[AsyncSession],
        tenant_ids: list[uuid.UUID],
    ) -> None:
        dead_store = RedisStore(DEAD_REDIS, prefix="x:")
        memory = MemoryOutbox()
        try:
            down = UsageRecorder(dead_sessions, [RedisOutbox(dead_store), memory])
            sent = event(tenant_ids[0])
            await down.record(sent)
            assert await memory.size() == 1
            assert down.num_lost == 0
            # The database comes back before Redis does: the in-process entry drains, the dead Redis is skipped.
            up = UsageRecorder(sessions, [RedisOutbox(dead_store), memory])
            assert await up.drain_once() == 1
            assert await memory.size() == 0
            [row] = await rows(sessions)
            assert (row.request_id, row.reasoning_tokens) == (sent.request_id, sent.reasoning_tokens)
        finally:
            await dead_store.close()

    async def test_embedded_mode_uses_an_in_process_outbox(
        self,
        sessions: async_sessionmaker[AsyncSession],
        dead_sessions: async_sessionmaker[AsyncSession],
        tenant_ids: list[uuid.UUID],
    ) -> None:
        down = open_usage_recorder(dead_sessions, MemoryStore())
        [outbox] = down.outboxes
        assert isinstance(outbox, MemoryOutbox)
        await down.record(event(tenant_ids[0]))
        up = UsageRecorder(sessions, [outbox])
        assert await up.drain_once() == 1
        assert await up.drain_once() == 0
        assert await count(sessions) == 1

    async def test_the_drainer_loop_drains_and_stops_when_told(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore, tenant_ids: list[uuid.UUID]
    ) -> None:
        """Stopped as the app's lifespan stops it: by its event, between rounds (a task cancelled in the middle of a
        database call can leave its connection half-closed, and awaiting it then hung a CI run for 10 minutes)."""
        await RedisOutbox(store).append(event(tenant_ids[0]).encode())
        stop = asyncio.Event()
        drainer = asyncio.create_task(open_usage_recorder(sessions, store).run_drainer(0.05, stop))
        try:

            async def drained() -> bool:
                return await count(sessions) == 1

            await wait_for_async(drained, 5, what="the drainer to write the entry")
        finally:
            stop.set()
            await asyncio.wait_for(drainer, 10)

    async def test_a_waiting_drainer_ends_on_cancel(
        self, sessions: async_sessionmaker[AsyncSession], store: RedisStore
    ) -> None:
        drainer = asyncio.create_task(open_usage_recorder(sessions, store).run_drainer(3600))
        await asyncio.sleep(0.05)  # in its wait for the next round
        drainer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(drainer, 10)


# ---------------------------------------------------------------------------------------------------------------
# GET /v1/usage


@pytest.fixture
def recorder(sessions: async_sessionmaker[AsyncSession], store: RedisStore) -> UsageRecorder:
    """A recorder on the app's database, in the test's event loop (the test client runs the app in another thread
    and loop, whose connections must not be used from here)."""
    return open_usage_recorder(sessions, store)


async def record_for(recorder: UsageRecorder, tenant: dict[str, Any], **changes: Any) -> UsageEvent:
    sent = event(uuid.UUID(tenant["id"]), **changes)
    await recorder.record(sent)
    return sent


class TestGetUsage:
    async def test_only_the_callers_rows_and_their_totals(
        self, client: Client, recorder: UsageRecorder, make_tenant: Callable[[str], Any]
    ) -> None:
        (mine, my_key), (theirs, their_key) = await make_tenant("mine"), await make_tenant("theirs")
        a = await record_for(recorder, mine, prompt_tokens=10, cached_tokens=4, completion_tokens=1, reasoning_tokens=1)
        b = await record_for(
            recorder,
            mine,
            prompt_tokens=20,
            cached_tokens=0,
            completion_tokens=2,
            reasoning_tokens=0,
            status="length",
            service_tier="flex",
        )
        await record_for(
            recorder, theirs, prompt_tokens=1000, cached_tokens=0, completion_tokens=1000, reasoning_tokens=700
        )

        response = await client.get("/v1/usage", headers=bearer(my_key))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "usage"
        assert body["totals"] == {
            "requests": 2,
            "prompt_tokens": 30,
            "cached_tokens": 4,
            "completion_tokens": 3,
            "reasoning_tokens": 1,
        }
        assert {r["request_id"] for r in body["data"]} == {a.request_id, b.request_id}
        shown = next(r for r in body["data"] if r["request_id"] == b.request_id)
        assert set(shown) == {
            "request_id",
            "model",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "reasoning_tokens",
            "status",
            "service_tier",
            "started_at",
            "finished_at",
        }
        assert shown["status"] == "length"
        assert (shown["completion_tokens"], shown["reasoning_tokens"]) == (2, 0)
        assert next(r for r in body["data"] if r["request_id"] == a.request_id)["reasoning_tokens"] == 1
        assert shown["service_tier"] == "flex"
        assert next(r for r in body["data"] if r["request_id"] == a.request_id)["service_tier"] == "default"
        assert shown["model"] == "support-bot"

        theirs_view = (await client.get("/v1/usage", headers=bearer(their_key))).json()
        assert theirs_view["totals"]["requests"] == 1
        assert theirs_view["totals"]["prompt_tokens"] == 1000

    async def test_range_default_is_the_last_day_and_end_is_exclusive(
        self, client: Client, recorder: UsageRecorder, make_tenant: Callable[[str], Any]
    ) -> None:
        tenant, key = await make_tenant("ranged")
        midnight = datetime(2024, 5, 1, tzinfo=UTC)
        old = await record_for(recorder, tenant, started_at=midnight - timedelta(hours=1), finished_at=midnight)
        at_end = await record_for(recorder, tenant, started_at=midnight, finished_at=midnight + timedelta(seconds=1))
        recent = await record_for(recorder, tenant)

        default = (await client.get("/v1/usage", headers=bearer(key))).json()
        assert [r["request_id"] for r in default["data"]] == [recent.request_id]
        start, end = datetime.fromisoformat(default["start"]), datetime.fromisoformat(default["end"])
        assert end - start == timedelta(hours=24)

        # ISO 8601 and unix seconds both work; a row that starts exactly at `end` is outside.
        for params in (
            {"start": "2024-04-30T00:00:00Z", "end": "2024-05-01T00:00:00Z"},
            {"start": str(int((midnight - timedelta(days=1)).timestamp())), "end": str(int(midnight.timestamp()))},
            {"start": "2024-04-30", "end": "2024-05-01T02:00:00+02:00"},
        ):
            body = (await client.get("/v1/usage", params=params, headers=bearer(key))).json()
            assert [r["request_id"] for r in body["data"]] == [old.request_id], params
            assert body["totals"]["requests"] == 1
        body = (
            await client.get("/v1/usage", params={"start": "2024-05-01", "end": "2024-05-02"}, headers=bearer(key))
        ).json()
        assert [r["request_id"] for r in body["data"]] == [at_end.request_id]

    async def test_pages_newest_first_with_totals_over_the_whole_range(
        self, client: Client, recorder: UsageRecorder, make_tenant: Callable[[str], Any]
    ) -> None:
        tenant, key = await make_tenant("paged")
        sent = [
            await record_for(recorder, tenant, started_at=NOW - timedelta(minutes=50 - i), prompt_tokens=i + 1)
            for i in range(5)
        ]
        newest_first = [e.request_id for e in reversed(sent)]
        seen: list[str] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 2} | ({"after": after} if after else {})
            page = (await client.get("/v1/usage", params=params, headers=bearer(key))).json()
            assert page["totals"]["requests"] == 5
            assert page["totals"]["prompt_tokens"] == 15
            seen += [r["request_id"] for r in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == newest_first

    async def test_another_tenants_cursor_shows_nothing(
        self, client: Client, recorder: UsageRecorder, make_tenant: Callable[[str], Any]
    ) -> None:
        (mine, my_key), (theirs, _) = await make_tenant("cursor-mine"), await make_tenant("cursor-theirs")
        await record_for(recorder, mine)
        foreign = await record_for(recorder, theirs)
        body = (await client.get("/v1/usage", params={"after": foreign.request_id}, headers=bearer(my_key))).json()
        assert body["data"] == []
        assert body["totals"]["requests"] == 1

    @pytest.mark.parametrize(
        ("params", "param"),
        [
            ({"start": "2024-05-02", "end": "2024-05-01"}, "start"),
            ({"start": "2024-05-01", "end": "2024-05-01"}, "start"),
            ({"start": "2024-01-01", "end": "2024-05-01"}, "end"),  # more than 92 days
            ({"start": "yesterday"}, "start"),
            ({"end": "nan"}, "end"),
            ({"start": "1e300"}, "start"),
        ],
    )
    async def test_bad_ranges_are_400(
        self, client: Client, make_tenant: Callable[[str], Any], params: dict[str, str], param: str
    ) -> None:
        _, key = await make_tenant("bad-range")
        response = await client.get("/v1/usage", params=params, headers=bearer(key))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param

    async def test_needs_a_tenant_key(self, client: Client, admin_headers: dict[str, str]) -> None:
        assert (await client.get("/v1/usage")).status_code == 401
        assert (await client.get("/v1/usage", headers=admin_headers)).status_code == 401


async def test_the_app_drains_the_outbox_in_the_background(
    integration_settings: Settings, store: RedisStore, admin_headers: dict[str, str]
) -> None:
    settings = integration_settings.model_copy(update={"usage_drain_interval_s": 0.05})
    await migrate(settings)
    async with AsyncTestClient(app=create_app(settings)) as client:
        tenant = (await client.post("/admin/tenants", json={"name": "drained"}, headers=admin_headers)).json()
        key = (await client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin_headers)).json()["key"]
        # As if a replica had deferred it while the database was down.
        redis_outbox = RedisOutbox(store)
        sent = event(uuid.UUID(tenant["id"]))
        await redis_outbox.append(sent.encode())

        async def listed() -> dict[str, Any] | None:
            body: dict[str, Any] = (await client.get("/v1/usage", headers=bearer(key))).json()
            return body if body["data"] else None

        body = await wait_for_async(listed, 5, what="the drained row in /v1/usage")
        assert [r["request_id"] for r in body["data"]] == [sent.request_id]
        assert await redis_outbox.size() == 0


async def test_embedded_sqlite_records_once_too(tmp_path: Any) -> None:
    settings = Settings(data_dir=tmp_path)
    await migrate(settings)
    engine = create_engine(settings.effective_database_url)
    try:
        sessions = create_session_factory(engine)
        async with sessions() as session:
            tenant = Tenant(name="embedded")
            session.add(tenant)
            await session.commit()
        recorder = open_usage_recorder(sessions, MemoryStore())
        sent = event(tenant.id)
        await recorder.record(sent)
        await recorder.record(sent)
        await recorder.outboxes[0].append(sent.encode())
        assert await recorder.drain_once() == 0
        assert recorder.num_deferred == 0
        [row] = await rows(sessions)
        assert row.started_at == sent.started_at
    finally:
        await engine.dispose()
