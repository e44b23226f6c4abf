"""Fault injection: the platform under load while its database or Redis stops or freezes, then comes back.

Each test runs the platform (embedded engine on the tiny checkpoint, as production runs it: uvicorn on a socket)
over a PostgreSQL cluster and a redis-server of this module's own, which it stops (connections refused) or freezes
(SIGSTOP: connections open, nothing answers, as on a hung host) while clients keep sending chat completions.
What must hold:
- every answer is a 200 or a 503 in OpenAI's envelope with Retry-After, never another 5xx, and none takes longer
  than the timeouts allow (no 30 s waits);
- once the dependency is back, requests succeed again;
- the usage ledger reconciles: every request whose id reached its client has exactly one row, with the tokens the
  client was told; a row for a request whose client never learned its id is `cancelled` with zero tokens (its
  client gave up before the engine was asked, so nothing ran); the engine ran exactly the requests with rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio
from _support import services
from _support.services import PostgresCluster, RedisProcess

from loraplex.platform.app import create_app
from loraplex.platform.domain.usage.recorder import OUTBOX_KEY, MemoryOutbox
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, SECRET_KEY, migrate, serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]
logger = logging.getLogger(__name__)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NUM_CLIENTS = 6
# A request of the tiny model takes tens of milliseconds; a client that waits this long has met the fault.
CLIENT_TIMEOUT_S = 1.5
UNAVAILABLE_CODES = {"database_unavailable", "service_unavailable"}


# --- servers this module may break ------------------------------------------------------------------------------


@contextlib.contextmanager
def _owned(server: PostgresCluster | RedisProcess, start: Callable[[], None]) -> Iterator[None]:
    """`start()` the server (failing the tests that need it with its message if it cannot), `remove()` it after."""
    try:
        start()
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield
    finally:
        server.remove()


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    value = PostgresCluster(durable_commits=True)  # a crash (stop) must not lose an acknowledged usage row
    with _owned(value, value.create):
        yield value


@pytest.fixture(scope="module")
def redis_process() -> Iterator[RedisProcess]:
    value = RedisProcess()
    with _owned(value, value.start):
        yield value


@pytest.fixture
def healthy(cluster: PostgresCluster, redis_process: RedisProcess) -> Iterator[None]:
    """Whatever a test did to the servers, the next one finds them up."""
    yield
    with contextlib.suppress(Exception):
        cluster.thaw()
    with contextlib.suppress(Exception):
        redis_process.thaw()
    if not _postgres_answers(cluster):
        cluster.start()
    if redis_process.port == 0 or not services.redis_answers(redis_process.port):
        redis_process.stop()
        redis_process.start()


def _postgres_answers(cluster: PostgresCluster) -> bool:
    async def probe() -> bool:
        try:
            connection = await asyncpg.connect(services.asyncpg_dsn(cluster.url), timeout=2)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        await connection.close()
        return True

    return asyncio.run(probe())


# --- the platform -----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one client saw of one request."""

    stream: bool
    started: float
    elapsed: float = 0.0
    status: int | None = None  # None: the client gave up before any answer
    request_id: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    retry_after: str | None = None


@dataclass
class Faulty:
    """The platform over `cluster` and `redis_process`, and the tenant that sends the load."""

    url: str
    resources: Resources
    cluster: PostgresCluster
    redis: RedisProcess
    database_url: str
    tenant_id: str
    key: str
    model: str  # the base model the embedded engine serves
    redis_prefix: str
    engine_calls: list[str] = field(default_factory=list)
    warm: Outcome | None = None  # the request that warmed it up, before the load
    scenario: str = ""

    async def load(
        self,
        seconds: float,
        *,
        fault: Callable[[], None],
        repair: Callable[[], None],
        client_timeout_s: float = CLIENT_TIMEOUT_S,
    ) -> list[Outcome]:
        """NUM_CLIENTS clients sending chat completions back to back for `seconds`, each giving up on a request
        after `client_timeout_s`: healthy for the first fifth, then `fault()`, then `repair()` at three fifths, then
        healthy again."""
        outcomes: list[Outcome] = []
        stop = time.monotonic() + seconds

        async def client(index: int) -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=client_timeout_s) as http:
                turn = 0
                while time.monotonic() < stop:
                    outcomes.append(await self._one(http, stream=(index + turn) % 2 == 1))
                    turn += 1

        async def script() -> None:
            await asyncio.sleep(seconds / 5)
            await asyncio.to_thread(fault)
            await asyncio.sleep(seconds * 2 / 5)
            await asyncio.to_thread(repair)

        await asyncio.gather(script(), *(client(i) for i in range(NUM_CLIENTS)))
        return outcomes

    async def _one(self, http: httpx.AsyncClient, *, stream: bool) -> Outcome:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"ticket {secrets.token_hex(4)}: the printer is on fire"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        outcome = Outcome(stream=stream, started=time.monotonic())
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                outcome.status = response.status_code
                outcome.request_id = response.headers.get("x-request-id")
                outcome.retry_after = response.headers.get("retry-after")
                raw = await response.aread()
        except httpx.TimeoutException:
            outcome.elapsed = time.monotonic() - outcome.started
            return outcome
        outcome.elapsed = time.monotonic() - outcome.started
        if outcome.status != 200:
            outcome.error = json.loads(raw)["error"]
        elif stream:
            events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]", events
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(c["id"] == outcome.request_id for c in chunks)
            outcome.usage = chunks[-1]["usage"]
        else:
            answer = json.loads(raw)
            assert answer["id"] == outcome.request_id
            outcome.usage = answer["usage"]
        return outcome

    def cold(self, fault: Callable[[], None]) -> Callable[[], None]:
        """`fault`, then the platform's cached configuration forgotten, so that every request needs the database
        again, as the first requests after a change do (with the cache warm they need none of it: see
        test_postgres_stopped_under_load_with_the_cache_warm)."""

        def run() -> None:
            fault()
            self.resources.config_cache.invalidate()

        return run

    async def rows(self) -> dict[str, asyncpg.Record]:
        connection = await asyncpg.connect(services.asyncpg_dsn(self.database_url), timeout=10)
        try:
            records = await connection.fetch(
                "SELECT request_id, status, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens "
                "FROM usage WHERE tenant_id = $1",
                uuid.UUID(self.tenant_id),
            )
        finally:
            await connection.close()
        return {r["request_id"]: r for r in records}

    async def drained(self, timeout_s: float = 30.0) -> None:
        """Wait until every usage event deferred to an outbox has reached the database. The platform's own Redis
        client lives on the server's event loop: the stream is read here with a client of this loop's."""
        deadline = time.monotonic() + timeout_s
        client = redis.asyncio.Redis.from_url(self.redis.url)
        try:
            while True:
                await asyncio.sleep(0.25)
                waiting = int(await client.xlen(self.redis_prefix + OUTBOX_KEY))
                for outbox in self.resources.usage.outboxes:
                    if isinstance(outbox, MemoryOutbox):
                        waiting += await outbox.size()
                if waiting == 0 and not self.resources.usage.num_in_flight:
                    return
                assert time.monotonic() < deadline, f"{waiting} usage events still in an outbox"
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def faulty_platform(
    tmp_path: Path,
    cluster: PostgresCluster,
    redis_process: RedisProcess,
    checkpoint: Path,
    **fields: Any,
) -> AsyncIterator[Faulty]:
    database = f"f_{secrets.token_hex(4)}"
    await services.create_database(cluster.url, database)
    database_url = services.database_url_for(cluster.url, database)
    settings = Settings(
        **{
            "data_dir": tmp_path / "data",
            "database_url": database_url,
            "redis_url": redis_process.url,
            "redis_prefix": f"f{secrets.token_hex(3)}:",
            "admin_token": ADMIN_TOKEN,
            "secret_key": SECRET_KEY,
            "engine_mode": "embedded",
            "engine_model": str(checkpoint),
            "engine_dtype": "float32",
            "engine_max_model_len": 256,
            "engine_kv_budget": "8MiB",
            "usage_drain_interval_s": 0.5,
            "default_requests_per_minute": 1_000_000,
            "database_statement_timeout_s": 2.0,
            "database_pool_timeout_s": 2.0,
            **fields,
        }
    )
    await migrate(settings)
    app = create_app(settings)
    with serving(app) as url:
        resources: Resources = app.state.resources
        async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as admin:
            tenant = (await admin.post("/admin/tenants", json={"name": "load"})).json()
            key = (await admin.post(f"/admin/tenants/{tenant['id']}/api-keys", json={})).json()["key"]
        engine = resources.embedded_engine
        assert engine is not None
        model = engine.core.served_model_name
        platform = Faulty(
            url, resources, cluster, redis_process, database_url, tenant["id"], key, model, settings.redis_prefix
        )
        submit = engine.submit  # the server submits every engine request through it

        def counting(*args: Any, **kwargs: Any) -> Any:
            platform.engine_calls.append(str(kwargs.get("request_id") or args[:1]))
            return submit(*args, **kwargs)

        engine.submit = counting  # type: ignore[method-assign]
        # Warm: the key is cached in Redis and the engine has run once, so the first fault meets a steady state.
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            warm = await platform._one(http, stream=False)
            assert warm.status == 200, warm
        platform.engine_calls.clear()
        platform.warm = warm
        platform.scenario = str(fields) or "defaults"
        try:
            yield platform
        finally:
            with contextlib.suppress(Exception):
                cluster.thaw()
            with contextlib.suppress(Exception):
                redis_process.thaw()


# --- what every scenario must show --------------------------------------------------------------------------------


async def reconcile(platform: Faulty, outcomes: list[Outcome], *, max_elapsed_s: float) -> dict[str, int]:
    """The checks of this module's docstring; returns counts by kind of outcome, for the failure messages."""
    for outcome in outcomes:
        assert outcome.status in (None, 200, 503), outcome
        if outcome.status is not None:
            assert outcome.elapsed < max_elapsed_s, outcome
        if outcome.status == 503:
            assert outcome.error is not None and outcome.error["code"] in UNAVAILABLE_CODES, outcome
            assert outcome.error["type"] == "server_error"
            assert outcome.retry_after is not None and int(outcome.retry_after) > 0, outcome
    # Healthy again at the end: the last request of every client succeeded.
    by_start = sorted(outcomes, key=lambda o: o.started)
    assert all(o.status == 200 for o in by_start[-NUM_CLIENTS:]), by_start[-NUM_CLIENTS:]
    await platform.drained()
    rows = await platform.rows()
    if platform.warm is not None and platform.warm.request_id is not None:
        rows.pop(platform.warm.request_id)
    returned = {o.request_id: o for o in outcomes if o.request_id is not None}
    for request_id, outcome in returned.items():
        assert request_id in rows, f"{request_id} reached its client but has no usage row: {outcome}"
        row = rows[request_id]
        if outcome.status == 200 and outcome.usage is not None:
            reasoning = outcome.usage["completion_tokens_details"]["reasoning_tokens"]
            told = (outcome.usage["prompt_tokens"], outcome.usage["completion_tokens"], reasoning)
            assert (row["prompt_tokens"], row["completion_tokens"], row["reasoning_tokens"]) == told, (row, outcome)
            assert row["status"] in ("ok", "length"), row
    unseen = [row for request_id, row in rows.items() if request_id not in returned]
    for row in unseen:
        assert row["status"] == "cancelled", row
        assert (
            row["prompt_tokens"] == row["cached_tokens"] == row["completion_tokens"] == row["reasoning_tokens"] == 0
        ), row
    # The engine ran the requests whose ids reached their clients, and nothing else.
    assert len(platform.engine_calls) == len(returned), (len(platform.engine_calls), len(returned), len(unseen))
    counts = {"ok": sum(o.status == 200 for o in outcomes), "503": sum(o.status == 503 for o in outcomes)}
    counts |= {"gave_up": sum(o.status is None for o in outcomes), "cancelled_rows": len(unseen)}
    answered = [o.elapsed for o in outcomes if o.status is not None]
    logger.info("%s: %s, slowest answer %.2f s", platform.scenario, counts, max(answered, default=0.0))
    return counts


# --- the scenarios ------------------------------------------------------------------------------------------------

Launch = Callable[..., contextlib.AbstractAsyncContextManager[Faulty]]


@pytest.fixture
def launch(
    tmp_path: Path, cluster: PostgresCluster, redis_process: RedisProcess, tiny_base_checkpoint: Path, healthy: None
) -> Launch:
    """`async with launch(**settings) as platform`: the platform on this module's servers, with these settings."""
    return functools.partial(faulty_platform, tmp_path, cluster, redis_process, tiny_base_checkpoint)


async def test_postgres_stopped_under_load(launch: Launch, cluster: PostgresCluster) -> None:
    """Crashed (pg_ctl -m immediate), then started again: connections are refused, answered 503 at once."""
    async with launch() as platform:
        outcomes = await platform.load(10, fault=platform.cold(cluster.stop), repair=cluster.start, client_timeout_s=30)
        counts = await reconcile(platform, outcomes, max_elapsed_s=5.0)
    assert counts["503"] > 0, counts


async def test_postgres_stopped_under_load_with_the_cache_warm(launch: Launch, cluster: PostgresCluster) -> None:
    """Crashed, then started again, while everything requests read is cached: every request is answered, its usage
    deferred to the outbox while the database is down and drained into it once it is back."""
    async with launch() as platform:
        outcomes = await platform.load(10, fault=cluster.stop, repair=cluster.start, client_timeout_s=30)
        counts = await reconcile(platform, outcomes, max_elapsed_s=5.0)
        deferred = platform.resources.usage.num_deferred
    assert counts["503"] == 0 and counts["ok"] > 0, counts
    assert deferred > 0, "the usage of no request met the outage"


async def test_postgres_frozen_past_the_timeouts_answers_503_in_seconds(
    launch: Launch, cluster: PostgresCluster
) -> None:
    """Frozen for 6 s with 1 s timeouts: requests that need the database answer 503 instead of hanging (the clients
    are patient here: they wait for the answer rather than give up)."""
    async with launch(database_statement_timeout_s=1.0, database_pool_timeout_s=1.0) as platform:
        outcomes = await platform.load(
            15, fault=platform.cold(cluster.freeze), repair=cluster.thaw, client_timeout_s=30
        )
        counts = await reconcile(platform, outcomes, max_elapsed_s=6.0)
    assert counts["503"] > 0, counts


async def test_postgres_frozen_briefly_runs_nothing_for_clients_that_gave_up(
    launch: Launch, cluster: PostgresCluster
) -> None:
    """Frozen for 4 s, under timeouts longer than that: clients give up after 1.5 s, the requests resume when the
    database does, and the engine is not asked to run any of them; each is recorded as cancelled, zero tokens."""
    async with launch(database_statement_timeout_s=20.0, database_pool_timeout_s=20.0) as platform:
        outcomes = await platform.load(10, fault=platform.cold(cluster.freeze), repair=cluster.thaw)
        # The client's timeout is httpx's, between reads: an answer begun just before the freeze may end after it.
        counts = await reconcile(platform, outcomes, max_elapsed_s=8.0)
    assert counts["gave_up"] > 0 and counts["cancelled_rows"] > 0, counts


async def test_redis_stopped_under_load(launch: Launch, redis_process: RedisProcess) -> None:
    """Keys are read from the database, rate limits admit (the open policy), usage goes straight to the database."""
    async with launch() as platform:
        outcomes = await platform.load(10, fault=redis_process.stop, repair=redis_process.start, client_timeout_s=30)
        counts = await reconcile(platform, outcomes, max_elapsed_s=5.0)
    assert counts["ok"] > 0, counts


async def test_redis_frozen_under_load(launch: Launch, redis_process: RedisProcess) -> None:
    """As stopped, once each call has waited out LORAPLEX_REDIS_TIMEOUT_S."""
    async with launch() as platform:
        outcomes = await platform.load(12, fault=redis_process.freeze, repair=redis_process.thaw, client_timeout_s=30)
        counts = await reconcile(platform, outcomes, max_elapsed_s=8.0)
    assert counts["ok"] > 0, counts
