"""Per-tenant concurrency caps: leases in a Redis sorted set (and the in-process substitute) that hold the cap, are
freed by a release, kept alive by renewal and expire when their holder stops renewing; the policy when Redis is
down; and, end to end through the platform (fleet mode, stub engines of test_completions_fleet), the 429 over the
cap, a stream holding its lease to its last byte, and the slots of a killed platform replica coming back.
"""

from __future__ import annotations

import asyncio
import gc
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.services import RedisServer
from _support.waiting import poll, wait_for_async
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.platform.concurrency import (
    HeldLease,
    Lease,
    LeaseDecision,
    LeaseRefusal,
    Leases,
    MemoryLeases,
    RedisLeases,
    concurrency_error,
    open_leases,
)
from loraplex.platform.domain.usage.recorder import MemoryOutbox, UsageRecorder
from loraplex.platform.kv import MemoryStore, RedisStore
from loraplex.platform.metrics import CountingLeases, PlatformMetrics
from loraplex.platform.ratelimit import MemoryRateLimiter
from loraplex.platform.settings import Settings

from . import test_completions_fleet as fleet
from .test_completions_fleet import ADMIN, MESSAGES, STUB_TEXT, Platform, metric, registered, serving_stub

pytestmark = pytest.mark.integration

# The fleet module's platform (its own Postgres database, Redis prefix and bucket), reused by name; module-scoped,
# so this module starts one of its own.
settings = fleet.settings
platform = fleet.platform

TTL_S = 1.0  # short leases: expiry is what these tests watch
DEAD_REDIS = "redis://127.0.0.1:1/0"  # port 1 is never a Redis: connections are refused at once
PREFIX = "loraplex_platform"

MakeLeases = Callable[..., Leases]


@pytest.fixture(params=["redis", "memory"])
async def make_leases(
    request: pytest.FixtureRequest, redis_server: RedisServer, redis_prefix: str
) -> AsyncIterator[MakeLeases]:
    """Builds leases of one kind. Redis ones built by one test share its key prefix: two of them are two replicas."""
    stores: list[RedisStore] = []

    def make(ttl_s: float = TTL_S) -> Leases:
        if request.param == "memory":
            return MemoryLeases(ttl_s=ttl_s)
        store = RedisStore(redis_server.url, prefix=redis_prefix)
        stores.append(store)
        return RedisLeases(store, ttl_s=ttl_s)

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
def leases(make_leases: MakeLeases) -> Leases:
    return make_leases()


def new_tenant_id() -> str:
    return str(uuid.uuid4())


async def take(leases: Leases, tenant_id: str, cap: int) -> Lease:
    decision = await leases.acquire(tenant_id, cap=cap)
    assert decision.lease is not None, decision
    return decision.lease


async def admits(leases: Leases, tenant_id: str, cap: int = 1) -> Lease | None:
    return (await leases.acquire(tenant_id, cap=cap)).lease


class SlowRelease:
    """`Leases` whose releases take a moment (a Redis round trip, stretched), to be cancelled in."""

    def __init__(self, inner: Leases) -> None:
        self._inner = inner
        self.releasing = asyncio.Event()

    @property
    def ttl_s(self) -> float:
        return self._inner.ttl_s

    async def acquire(self, tenant_id: str, *, cap: int) -> LeaseDecision:
        return await self._inner.acquire(tenant_id, cap=cap)

    async def renew(self, lease: Lease) -> None:
        await self._inner.renew(lease)

    async def release(self, lease: Lease) -> None:
        self.releasing.set()
        await asyncio.sleep(0.1)
        await self._inner.release(lease)


# --- lease semantics, in Redis and in process -------------------------------------------------------------------


class TestCap:
    async def test_admits_up_to_the_cap_then_refuses(self, leases: Leases) -> None:
        tenant_id = new_tenant_id()
        decisions = [await leases.acquire(tenant_id, cap=3) for _ in range(3)]
        assert [d.num_held for d in decisions] == [1, 2, 3]
        assert len({d.lease.lease_id for d in decisions if d.lease is not None}) == 3
        refused = await leases.acquire(tenant_id, cap=3)
        assert (refused.lease, refused.refusal, refused.num_held, refused.cap) == (None, LeaseRefusal.OVER_CAP, 3, 3)
        assert await admits(leases, tenant_id, cap=4) is not None  # a raised cap admits at once
        assert await admits(leases, new_tenant_id()) is not None  # another tenant's slots are its own

    async def test_a_release_frees_a_slot_at_once(self, leases: Leases) -> None:
        tenant_id = new_tenant_id()
        first = await take(leases, tenant_id, 2)
        await take(leases, tenant_id, 2)
        assert await admits(leases, tenant_id, cap=2) is None
        await leases.release(first)
        assert await admits(leases, tenant_id, cap=2) is not None
        await leases.release(first)  # twice: a no-op, never another request's slot
        assert await admits(leases, tenant_id, cap=2) is None

    async def test_a_cap_below_one_is_a_value_error(self, leases: Leases) -> None:
        with pytest.raises(ValueError, match="at least 1"):
            await leases.acquire(new_tenant_id(), cap=0)


class TestExpiry:
    async def test_an_abandoned_lease_expires_after_its_ttl(self, leases: Leases) -> None:
        tenant_id = new_tenant_id()
        await take(leases, tenant_id, 1)
        taken = time.monotonic()
        assert await admits(leases, tenant_id) is None
        await wait_for_async(lambda: admits(leases, tenant_id), TTL_S + 1, what="the abandoned lease to expire")
        assert time.monotonic() - taken >= TTL_S - 0.05  # not before its ttl (Redis counts in milliseconds)

    async def test_renewal_keeps_a_lease_alive_past_its_ttl(self, leases: Leases) -> None:
        tenant_id = new_tenant_id()
        lease = await take(leases, tenant_id, 1)
        for _ in range(4):  # two ttls in all, renewed every half ttl: time passing is what is tested
            await asyncio.sleep(TTL_S / 2)
            await leases.renew(lease)
        assert await admits(leases, tenant_id) is None
        await wait_for_async(lambda: admits(leases, tenant_id), TTL_S + 1, what="the lease to expire once unrenewed")

    async def test_a_lease_renewed_after_it_expired_counts_again(self, leases: Leases) -> None:
        """Its request is still running (its holder only missed renewals, Redis was away): it takes its slot back."""
        tenant_id = new_tenant_id()
        lease = await take(leases, tenant_id, 1)
        await asyncio.sleep(TTL_S + 0.1)  # past the ttl, unrenewed
        await leases.renew(lease)
        assert await admits(leases, tenant_id) is None
        await leases.release(lease)
        assert await admits(leases, tenant_id) is not None


class TestHeldLease:
    async def test_a_held_lease_is_renewed_in_the_background_until_released(self, leases: Leases) -> None:
        tenant_id = new_tenant_id()
        held = HeldLease(leases, await take(leases, tenant_id, 1))
        await asyncio.sleep(TTL_S * 2.5)  # past two ttls: only the background renewals keep it
        assert await admits(leases, tenant_id) is None
        await held.release()
        again = await take(leases, tenant_id, 1)
        await held.release()  # idempotent: the slot taken since stays taken
        assert await admits(leases, tenant_id) is None
        await leases.release(again)

    async def test_a_release_cancelled_midway_still_frees_the_slot(self, leases: Leases) -> None:
        """A client gone at the wrong moment cancels its request's task while the release is on its way to Redis."""
        tenant_id = new_tenant_id()
        slow = SlowRelease(leases)
        held = HeldLease(slow, await take(slow, tenant_id, 1))
        task = asyncio.ensure_future(held.release())
        await slow.releasing.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for_async(lambda: admits(leases, tenant_id), TTL_S / 2, what="the shielded release")

    async def test_a_lease_dropped_without_a_release_stops_renewing_and_expires(self, leases: Leases) -> None:
        """A response discarded before it was sent must not keep its tenant's slot for the life of the process."""
        tenant_id = new_tenant_id()
        held: HeldLease | None = HeldLease(leases, await take(leases, tenant_id, 1))
        assert held is not None
        del held
        gc.collect()
        await wait_for_async(lambda: admits(leases, tenant_id), TTL_S * 2, what="the dropped lease to expire")


async def test_replicas_share_each_tenants_cap(redis_server: RedisServer, redis_prefix: str) -> None:
    stores = [RedisStore(redis_server.url, prefix=redis_prefix) for _ in range(2)]
    try:
        first, second = (RedisLeases(store, ttl_s=TTL_S) for store in stores)
        tenant_id = new_tenant_id()
        lease = await take(first, tenant_id, 2)
        await take(second, tenant_id, 2)
        assert await admits(first, tenant_id, cap=2) is None
        assert await admits(second, tenant_id, cap=2) is None
        await second.release(lease)  # any replica may free a slot (the member is the lease id)
        assert await admits(first, tenant_id, cap=2) is not None
    finally:
        for store in stores:
            await store.close()


async def test_concurrent_acquires_never_pass_the_cap(leases: Leases) -> None:
    tenant_id = new_tenant_id()
    decisions = await asyncio.gather(*(leases.acquire(tenant_id, cap=5) for _ in range(40)))
    assert sum(d.lease is not None for d in decisions) == 5


# --- Redis down, errors, wiring ---------------------------------------------------------------------------------


class TestStoreDown:
    async def test_open_policy_admits_without_a_lease_to_renew_or_release(self) -> None:
        store = RedisStore(DEAD_REDIS, prefix="x:")
        try:
            leases = RedisLeases(store, ttl_s=TTL_S, failure_policy="open")
            decision = await leases.acquire(new_tenant_id(), cap=1)
            assert decision.lease is not None and not decision.lease.tracked
            await leases.renew(decision.lease)  # nothing to do, and nothing raised
            held = HeldLease(leases, decision.lease)
            await held.release()
        finally:
            await store.close()

    async def test_closed_policy_refuses_with_503(self) -> None:
        store = RedisStore(DEAD_REDIS, prefix="x:")
        try:
            leases = RedisLeases(store, ttl_s=TTL_S, failure_policy="closed")
            decision = await leases.acquire(new_tenant_id(), cap=1)
            assert (decision.lease, decision.refusal) == (None, LeaseRefusal.UNAVAILABLE)
            error = concurrency_error(decision)
            assert (error.status_code, error.code) == (503, "concurrency_limiter_unavailable")
            assert error.headers["Retry-After"] == "1"
        finally:
            await store.close()

    def test_open_leases_follows_the_store_the_policy_and_the_ttl(self, tmp_path: Path) -> None:
        settings = Settings(data_dir=tmp_path, ratelimit_failure_policy="closed", concurrency_lease_ttl_s=12)
        memory = open_leases(MemoryStore(), settings)
        assert isinstance(memory, MemoryLeases) and memory.ttl_s == 12
        redis_leases = open_leases(RedisStore(DEAD_REDIS, prefix="x:"), settings)
        assert isinstance(redis_leases, RedisLeases) and redis_leases.ttl_s == 12
        assert redis_leases._policy == "closed"


def test_over_the_cap_is_a_429_with_retry_after() -> None:
    error = concurrency_error(LeaseDecision(cap=4, num_held=4, refusal=LeaseRefusal.OVER_CAP))
    assert (error.status_code, error.code) == (429, "concurrency_limit_exceeded")
    assert error.headers == {"Retry-After": "1", "retry-after-ms": "1000"}
    assert "at most 4" in error.message
    with pytest.raises(ValueError, match="admitted"):
        concurrency_error(LeaseDecision(cap=4, num_held=1, lease=Lease("t", "l")))


async def test_counting_leases_count_in_flight_and_refusals_per_tenant() -> None:
    recorder = UsageRecorder(async_sessionmaker(), [MemoryOutbox()])  # never writes here
    metrics = PlatformMetrics(MemoryRateLimiter(), recorder)
    counting = CountingLeases(MemoryLeases(ttl_s=TTL_S), metrics)
    first = await take(counting, "t", 2)
    await take(counting, "t", 2)
    assert await admits(counting, "t", cap=2) is None
    await counting.release(first)
    exposition = metrics.render().decode()
    assert f'{PREFIX}_requests_in_flight{{tenant="t"}} 1.0' in exposition
    assert f'{PREFIX}_concurrency_refusals_total{{reason="over_cap",tenant="t"}} 1.0' in exposition
    assert f"{PREFIX}_concurrency_unavailable_total 0.0" in exposition


# --- end to end through the platform ----------------------------------------------------------------------------


def capped_tenant(platform: Platform, cap: int) -> tuple[str, str]:
    """A new tenant (id, key) whose concurrency cap an admin set to `cap`."""
    body = {"name": f"capped-{secrets.token_hex(3)}", "limits": {"max_concurrent_requests": cap}}
    response = platform.post("/admin/tenants", ADMIN, json=body)
    assert response.status_code == 201, response.text
    assert response.json()["limits"]["max_concurrent_requests"] == cap
    tenant_id = response.json()["id"]
    response = platform.post(f"/admin/tenants/{tenant_id}/api-keys", ADMIN, json={"name": "k"})
    assert response.status_code == 201, response.text
    return tenant_id, response.json()["key"]


def sdk(platform: Platform, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=30)


def ask(platform: Platform, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    return platform.post("/v1/chat/completions", {"Authorization": f"Bearer {key}"}, json=body)


@pytest.fixture
def stub_model(settings: Settings, platform: Platform, tiny_base_checkpoint: Path) -> Iterator[tuple[str, Any]]:
    """(base model, stub engine): a base model of this test's own, served by one registered stub."""
    name = fleet.stub_base_model(platform, tiny_base_checkpoint)
    with serving_stub(base_model=name) as stub, registered(settings, platform, stub):
        yield name, stub


def test_over_its_cap_a_tenant_gets_429_until_a_stream_it_holds_has_sent_its_last_byte(
    platform: Platform, stub_model: tuple[str, Any]
) -> None:
    model, stub = stub_model
    tenant_id, key = capped_tenant(platform, 1)
    other_id, other_key = capped_tenant(platform, 1)
    client = sdk(platform, key)
    in_flight = f"{PREFIX}_requests_in_flight"

    stub.midway.clear()  # the stream's first chunk comes, the rest waits
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.content == STUB_TEXT
    assert metric(platform, in_flight, tenant=tenant_id) == 1

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert (info.value.status_code, info.value.code) == (429, "concurrency_limit_exceeded")
    assert info.value.type == "rate_limit_error"
    assert info.value.response.headers["retry-after"] == "1"
    assert len(stub.received) == 1  # refused before any engine saw it
    assert metric(platform, f"{PREFIX}_concurrency_refusals_total", tenant=tenant_id, reason="over_cap") == 1

    # Another tenant's cap is its own (its request waits midway like the first: answered in a thread).
    answered: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answered.append(ask(platform, other_key, model)))
    thread.start()
    assert poll(lambda: len(stub.received) == 2, 10)

    stub.midway.set()
    assert [c.choices[0].finish_reason for c in chunks] == ["stop"]  # the rest of the stream, to its end
    thread.join(30)
    assert [r.status_code for r in answered] == [200]
    assert ask(platform, key, model).status_code == 200  # its slot came back with the stream's last byte
    assert metric(platform, in_flight, tenant=tenant_id) == 0
    assert metric(platform, in_flight, tenant=other_id) == 0


def test_a_client_leaving_mid_stream_frees_its_slot(platform: Platform, stub_model: tuple[str, Any]) -> None:
    model, stub = stub_model
    tenant_id, key = capped_tenant(platform, 1)
    in_flight = f"{PREFIX}_requests_in_flight"
    stub.midway.clear()
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "stream": True},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_text()  # held: dropping it would close the connection here and now
        assert STUB_TEXT in next(chunks)
        assert ask(platform, key, model).status_code == 429
    # Gone: the platform closes its engine request and frees the slot, without the engine ever finishing (the
    # stub still holds every answer midway, so the slot is read off the metric, not by asking: an admitted request
    # would wait there too).
    assert poll(lambda: metric(platform, in_flight, tenant=tenant_id) == 0, 10)
    stub.midway.set()
    assert ask(platform, key, model).status_code == 200


# A platform replica, reduced to what matters here: it admits `count` requests of a tenant against the shared Redis
# (the platform's own code and keys), holds them with renewals as a request in flight does, and never ends them.
REPLICA = """
import asyncio, sys
from loraplex.platform.concurrency import HeldLease, RedisLeases
from loraplex.platform.kv import RedisStore

async def main(url, prefix, tenant_id, count, ttl_s):
    leases = RedisLeases(RedisStore(url, prefix=prefix), ttl_s=ttl_s)
    held = []
    for _ in range(count):
        decision = await leases.acquire(tenant_id, cap=count)
        assert decision.lease is not None, decision
        held.append(HeldLease(leases, decision.lease))
    print("held", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
"""
REPLICA_TTL_S = 2.0


def test_the_leases_of_a_killed_replica_expire_and_give_its_slots_back(
    settings: Settings, platform: Platform, stub_model: tuple[str, Any]
) -> None:
    """A replica killed (SIGKILL: no finally, no release) with two requests of a tenant in flight: the tenant stays
    at its cap while the replica renews, and is admitted again within a ttl of the kill, with nobody cleaning up."""
    assert settings.redis_url is not None
    model, _ = stub_model
    tenant_id, key = capped_tenant(platform, 2)
    command = [sys.executable, "-c", REPLICA, settings.redis_url, settings.redis_prefix, tenant_id, "2"]
    replica = subprocess.Popen([*command, str(REPLICA_TTL_S)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert replica.stdout is not None and replica.stdout.readline().strip() == b"held"
        assert ask(platform, key, model).status_code == 429
        time.sleep(REPLICA_TTL_S * 1.5)  # past the ttl: only the replica's renewals keep the slots
        assert ask(platform, key, model).status_code == 429

        replica.send_signal(signal.SIGKILL)
        replica.wait(10)
        killed = time.monotonic()
        assert ask(platform, key, model).status_code == 429  # a lease lives on for up to a ttl after its last renewal
        assert poll(lambda: ask(platform, key, model).status_code == 200, REPLICA_TTL_S + 3)
        assert time.monotonic() - killed <= REPLICA_TTL_S + 1
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait(10)
