"""A completion's admission in one round trip (decision 0038): the Redis script that checks the configuration
generation, the four rate-limit buckets and the tenant's lease together must decide exactly as the rate limiter and
the leases asked one after the other (the in-process `SequentialGate` is that reference), share their keys with
them, charge nothing for a stale generation, and keep the failure policy. Real Redis, no mocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from _support.services import RedisServer
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.platform.admission import Admission, Admitter, Gate, RedisGate, SequentialGate, open_gate
from loraplex.platform.concurrency import (
    HeldLease,
    LeaseRefusal,
    MemoryLeases,
    RedisLeases,
)
from loraplex.platform.config_cache import GENERATION_KEY, ConfigCache
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.recorder import MemoryOutbox, UsageRecorder
from loraplex.platform.kv import KeyValueStore, MemoryStore, RedisStore
from loraplex.platform.metrics import CountingLeases, PlatformMetrics
from loraplex.platform.ratelimit import Limits, MemoryRateLimiter, RedisRateLimiter, Refusal
from loraplex.platform.settings import Settings

from . import test_completions_fleet as fleet
from . import test_concurrency
from .test_completions_fleet import Platform
from .test_concurrency import ask, capped_tenant

pytestmark = pytest.mark.integration

TTL_S = 30.0
DEAD_REDIS = "redis://127.0.0.1:1/0"  # port 1 is never a Redis: connections are refused at once
ROOMY = Limits(10**6, 10**9)


class Setup:
    """A gate and what it decides with: the store (its generation), and the limiter and leases of the same kind."""

    def __init__(
        self, kv: KeyValueStore, limiter: RedisRateLimiter | MemoryRateLimiter, leases: RedisLeases | MemoryLeases
    ):
        self.kv, self.limiter, self.leases = kv, limiter, leases
        self.cache = ConfigCache(kv)
        self.gate: Gate = open_gate(self.cache, limiter, leases)

    async def admit(
        self,
        tenant_id: str,
        key_id: str = "k",
        *,
        tenant: Limits = ROOMY,
        key: Limits = ROOMY,
        tokens: int = 1,
        cap: int = 100,
        generation: bytes | None = None,
    ) -> Admission:
        return await self.gate.admit(
            tenant_id=tenant_id, key_id=key_id, tenant=tenant, key=key, tokens=tokens, cap=cap, generation=generation
        )


@pytest.fixture(params=["redis", "memory"])
async def setup(request: pytest.FixtureRequest, redis_server: RedisServer, redis_prefix: str) -> AsyncIterator[Setup]:
    if request.param == "memory":
        yield Setup(MemoryStore(), MemoryRateLimiter(), MemoryLeases(ttl_s=TTL_S))
        return
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    made = Setup(store, RedisRateLimiter(store), RedisLeases(store, ttl_s=TTL_S))
    assert isinstance(made.gate, RedisGate)
    yield made
    await store.close()


def new_tenant_id() -> str:
    return str(uuid.uuid4())


def outcome(admission: Admission) -> tuple[bool, Refusal | None, bool, LeaseRefusal | None]:
    """(rate allowed, rate refusal, lease taken, lease refusal)."""
    assert admission.rate is not None
    lease = admission.lease
    return (
        admission.rate.allowed,
        admission.rate.refusal,
        lease is not None and lease.lease is not None,
        None if lease is None else lease.refusal,
    )


ADMITTED = (True, None, True, None)
RATE_LIMITED = (False, Refusal.RATE_LIMITED, False, None)
OVER_CAP = (True, None, False, LeaseRefusal.OVER_CAP)


class TestLimitsAndLeases:
    async def test_the_rate_limit_refuses_before_a_lease_is_taken(self, setup: Setup) -> None:
        tenant_id = new_tenant_id()
        limits = Limits(2, 10**6)
        results = [outcome(await setup.admit(tenant_id, tenant=limits, cap=5)) for _ in range(3)]
        assert results == [ADMITTED, ADMITTED, RATE_LIMITED]
        # Two leases held, not three: the refused request took none (a third fits under a cap of 3).
        assert (await setup.leases.acquire(tenant_id, cap=3)).lease is not None
        assert (await setup.leases.acquire(tenant_id, cap=3)).lease is None

    async def test_the_keys_limits_are_its_own(self, setup: Setup) -> None:
        tenant_id = new_tenant_id()
        one = Limits(1, 10**6)
        assert outcome(await setup.admit(tenant_id, "a", key=one)) == ADMITTED
        assert outcome(await setup.admit(tenant_id, "a", key=one)) == RATE_LIMITED
        assert outcome(await setup.admit(tenant_id, "b", key=one)) == ADMITTED

    async def test_over_the_cap_the_lease_is_refused_and_the_buckets_stay_charged(self, setup: Setup) -> None:
        """As when the limiter and the leases were asked one after the other: the buckets admitted, so they paid."""
        tenant_id = new_tenant_id()
        limits = Limits(3, 10**6)
        assert outcome(await setup.admit(tenant_id, tenant=limits, cap=1)) == ADMITTED
        refused = await setup.admit(tenant_id, tenant=limits, cap=1)
        assert outcome(refused) == OVER_CAP
        assert refused.lease is not None and (refused.lease.cap, refused.lease.num_held) == (1, 1)
        assert outcome(await setup.admit(tenant_id, tenant=limits, cap=2)) == ADMITTED
        assert outcome(await setup.admit(tenant_id, tenant=limits, cap=5)) == RATE_LIMITED  # 3 charged already

    async def test_tokens_are_charged_and_a_request_too_large_takes_nothing(self, setup: Setup) -> None:
        tenant_id = new_tenant_id()
        limits = Limits(10**6, 100)
        too_large = await setup.admit(tenant_id, tenant=limits, tokens=101, cap=1)
        assert outcome(too_large) == (False, Refusal.TOO_LARGE, False, None)
        assert outcome(await setup.admit(tenant_id, tenant=limits, tokens=60, cap=5)) == ADMITTED
        refused = await setup.admit(tenant_id, tenant=limits, tokens=60, cap=5)
        assert outcome(refused) == RATE_LIMITED
        assert refused.rate is not None and 11 <= refused.rate.retry_after_s <= 12  # 20 tokens short, 100 a minute
        assert refused.rate.headers["x-ratelimit-remaining-tokens"] == "40"
        assert outcome(await setup.admit(tenant_id, tenant=limits, tokens=40, cap=5)) == ADMITTED

    async def test_it_shares_its_keys_with_the_limiter_and_the_leases(self, setup: Setup) -> None:
        """A replica that asks the two apart (an older one, or the retries' path) sees what the gate took, and the
        gate sees theirs."""
        tenant_id = new_tenant_id()
        one = Limits(1, 10**6)
        assert outcome(await setup.admit(tenant_id, tenant=one, cap=1)) == ADMITTED
        apart = await setup.limiter.acquire(tenant_id=tenant_id, key_id="k", tenant=one, key=ROOMY, tokens=1)
        assert apart.refusal is Refusal.RATE_LIMITED
        assert (await setup.leases.acquire(tenant_id, cap=1)).refusal is LeaseRefusal.OVER_CAP
        other = new_tenant_id()
        taken = await setup.leases.acquire(other, cap=1)
        assert taken.lease is not None
        assert outcome(await setup.admit(other, cap=1)) == OVER_CAP
        await setup.leases.release(taken.lease)
        assert outcome(await setup.admit(other, cap=1)) == ADMITTED

    async def test_concurrent_admissions_pass_neither_the_cap_nor_the_limit(self, setup: Setup) -> None:
        capped, limited = new_tenant_id(), new_tenant_id()
        by_cap = await asyncio.gather(*(setup.admit(capped, cap=5) for _ in range(40)))
        assert sum(outcome(a) == ADMITTED for a in by_cap) == 5
        by_rate = await asyncio.gather(*(setup.admit(limited, tenant=Limits(3, 10**6)) for _ in range(40)))
        assert sum(outcome(a) == ADMITTED for a in by_rate) == 3


class TestGeneration:
    async def test_a_stale_generation_decides_and_charges_nothing(self, setup: Setup) -> None:
        tenant_id = new_tenant_id()
        first = await setup.admit(tenant_id, tenant=Limits(1, 10**6), cap=1)
        assert outcome(first) == ADMITTED and first.generation is not None  # started, as the cache would
        assert first.generation == await setup.kv.get(GENERATION_KEY)
        other = new_tenant_id()
        stale = await setup.admit(other, tenant=Limits(1, 10**6), cap=1, generation=b"not-it")
        assert stale.stale and (stale.rate, stale.lease, stale.generation) == (None, None, first.generation)
        current = await setup.admit(other, tenant=Limits(1, 10**6), cap=1, generation=first.generation)
        assert outcome(current) == ADMITTED  # the stale one took neither the bucket's one request nor the slot

    async def test_a_new_generation_makes_the_old_one_stale(self, setup: Setup) -> None:
        known = (await setup.admit(new_tenant_id())).generation
        assert known is not None
        await setup.cache.publish()  # a change, from any replica
        stale = await setup.admit(new_tenant_id(), generation=known)
        assert stale.stale and stale.generation not in (None, known)


class TestStoreDown:
    @pytest.mark.parametrize("policy", ["open", "closed"])
    async def test_the_failure_policy_decides_as_for_the_two_apart(self, policy: str) -> None:
        store = RedisStore(DEAD_REDIS, prefix="x:")
        try:
            limiter = RedisRateLimiter(store, failure_policy=policy)  # type: ignore[arg-type]
            gate = open_gate(ConfigCache(store), limiter, RedisLeases(store, failure_policy=policy))  # type: ignore[arg-type]
            admission = await gate.admit(
                tenant_id="t", key_id="k", tenant=ROOMY, key=ROOMY, tokens=1, cap=1, generation=b"g"
            )
        finally:
            await store.close()
        assert admission.generation is None and not admission.stale
        assert limiter.num_unavailable == 1
        if policy == "open":
            assert outcome(admission) == ADMITTED
            assert admission.lease is not None and admission.lease.lease is not None
            assert not admission.lease.lease.tracked
        else:
            assert outcome(admission) == (False, Refusal.UNAVAILABLE, False, None)


async def test_a_release_in_the_background_frees_the_slot_before_the_tenants_next_admission(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """The answer goes out before the release reaches the store; the same client's next request, on this replica,
    still finds its slot free."""
    store = RedisStore(redis_server.url, prefix=redis_prefix)
    try:
        metrics = PlatformMetrics(MemoryRateLimiter(), UsageRecorder(async_sessionmaker(), [MemoryOutbox()]))
        leases = RedisLeases(store, ttl_s=TTL_S)
        admitter = Admitter(RedisGate(RedisRateLimiter(store), leases), metrics)
        admit: Callable[[], object] = lambda: admitter.admit(  # noqa: E731
            tenant_id="t", key_id="k", tenant=ROOMY, key=ROOMY, tokens=1, cap=1, generation=None
        )
        for _ in range(20):
            admission = await admit()  # type: ignore[misc]
            assert isinstance(admission, Admission) and admission.lease is not None
            assert admission.lease.lease is not None, "the previous request's slot was not free"
            admitter.release_soon(HeldLease(CountingLeases(leases, metrics), admission.lease.lease))
        await admitter.settled()
        assert (await leases.acquire("t", cap=1)).lease is not None
    finally:
        await store.close()


def test_the_memory_mode_asks_one_after_the_other() -> None:
    kv = MemoryStore()
    assert isinstance(open_gate(ConfigCache(kv), MemoryRateLimiter(), MemoryLeases()), SequentialGate)


# --- end to end: a change another replica published is checked by the next admission ---------------------------

settings = fleet.settings
platform = fleet.platform
stub_model = test_concurrency.stub_model


async def _by_hand(settings: Settings, tenant_id: str, requests_per_minute: int) -> None:
    """Change the tenant's limit in the database only: nothing is published, as from another replica's commit."""
    engine = create_engine(settings.effective_database_url)
    try:
        async with create_session_factory(engine)() as session:
            tenant = await session.get(Tenant, uuid.UUID(tenant_id))
            assert tenant is not None
            tenant.requests_per_minute = requests_per_minute
            await session.commit()
    finally:
        await engine.dispose()


async def _publish(settings: Settings) -> None:
    """What that replica does next: start a new generation."""
    assert settings.redis_url is not None
    store = RedisStore(settings.redis_url, prefix=settings.redis_prefix)
    try:
        await ConfigCache(store).publish()
    finally:
        await store.close()


def test_the_next_admission_after_a_published_change_applies_it(
    settings: Settings, platform: Platform, stub_model: tuple[str, Any]
) -> None:
    """The platform looks the tenant's terms up in its tables before it reads the generation (in the admission's
    script); a new generation makes it look again, so the new limit is the one applied."""
    model, _ = stub_model
    tenant_id, key = capped_tenant(platform, 5)
    assert ask(platform, key, model).status_code == 200  # the terms are cached
    asyncio.run(_by_hand(settings, tenant_id, 1))
    assert ask(platform, key, model).status_code == 200  # unpublished: the cached terms still apply
    asyncio.run(_publish(settings))
    answers = [ask(platform, key, model) for _ in range(2)]
    assert 429 in [a.status_code for a in answers], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
