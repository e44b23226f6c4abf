"""Rate limits: GCRA buckets per tenant and per key, all-or-nothing, shared by replicas through Redis; the same
behaviour from the in-process limiter; the policy when Redis is down; and the limits an admin sets on a tenant."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from loraplex.platform.kv import MemoryStore, RedisStore
from loraplex.platform.ratelimit import (
    Limits,
    MemoryRateLimiter,
    RateDecision,
    RateLimiter,
    RedisRateLimiter,
    Refusal,
    format_duration,
    open_rate_limiter,
    rate_limit_error,
)
from loraplex.platform.settings import Settings

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
DEAD_REDIS = "redis://127.0.0.1:1/0"  # port 1 is never a Redis: connections are refused at once
PLENTY = Limits(requests_per_minute=10_000, tokens_per_minute=10_000_000)

MakeLimiter = Callable[[], Awaitable[RateLimiter]]


@pytest.fixture(params=["redis", "memory"])
async def make_limiter(
    request: pytest.FixtureRequest, redis_server: Any, redis_prefix: str
) -> AsyncIterator[MakeLimiter]:
    """Builds limiters of one kind. Redis limiters built by one test share its key prefix: two of them are two
    replicas of one deployment."""
    stores: list[RedisStore] = []

    async def make() -> RateLimiter:
        if request.param == "memory":
            return MemoryRateLimiter()
        store = RedisStore(redis_server.url, prefix=redis_prefix)
        stores.append(store)
        return RedisRateLimiter(store)

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
async def limiter(make_limiter: MakeLimiter) -> RateLimiter:
    return await make_limiter()


def new_ids() -> tuple[str, str]:
    return str(uuid.uuid4()), uuid.uuid4().hex[:16]


async def take(
    limiter: RateLimiter, tenant_id: str, key_id: str, *, tenant: Limits = PLENTY, key: Limits = PLENTY, tokens: int = 1
) -> RateDecision:
    return await limiter.acquire(tenant_id=tenant_id, key_id=key_id, tenant=tenant, key=key, tokens=tokens)


def reset_seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", value)
    assert match is not None, value
    return float(match.group(1))


class TestBurstAndRefill:
    async def test_burst_up_to_the_limit_then_refused_with_retry_after(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        three = Limits(requests_per_minute=3, tokens_per_minute=1_000)
        admitted = [await take(limiter, tenant_id, key_id, tenant=three) for _ in range(3)]
        assert all(d.allowed for d in admitted)
        assert [d.headers["x-ratelimit-remaining-requests"] for d in admitted] == ["2", "1", "0"]
        assert admitted[0].headers["x-ratelimit-limit-requests"] == "3"
        # One request is worth 20 s of a 3-per-minute budget: the bucket is full again 60 s after three.
        assert 19.5 < reset_seconds(admitted[0].headers["x-ratelimit-reset-requests"]) <= 20.0
        assert 59.5 < reset_seconds(admitted[2].headers["x-ratelimit-reset-requests"]) <= 60.0

        refused = await take(limiter, tenant_id, key_id, tenant=three)
        assert not refused.allowed
        assert refused.refusal is Refusal.RATE_LIMITED
        assert 19.0 < refused.retry_after_s <= 20.0  # the next request is allowed 20 s after the first
        assert "requests per minute" in refused.message
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"

    async def test_refills_over_time(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        fast = Limits(requests_per_minute=100, tokens_per_minute=600)  # one token every 0.1 s
        assert (await take(limiter, tenant_id, key_id, tenant=fast, tokens=600)).allowed
        refused = await take(limiter, tenant_id, key_id, tenant=fast, tokens=3)
        assert not refused.allowed
        assert 0.1 < refused.retry_after_s <= 0.3  # 3 tokens at one per 0.1 s, less the time since
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        await asyncio.sleep(refused.retry_after_s + 0.05)
        later = await take(limiter, tenant_id, key_id, tenant=fast, tokens=3)
        assert later.allowed
        # Refilled exactly as much as it took: nothing more is left.
        assert not (await take(limiter, tenant_id, key_id, tenant=fast, tokens=3)).allowed

    async def test_tokens_bucket_counts_the_estimate(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        budget = Limits(requests_per_minute=100, tokens_per_minute=1_000)
        first = await take(limiter, tenant_id, key_id, tenant=budget, tokens=700)
        assert first.allowed
        assert first.headers["x-ratelimit-remaining-tokens"] == "300"
        refused = await take(limiter, tenant_id, key_id, tenant=budget, tokens=400)
        assert not refused.allowed
        assert "tokens per minute" in refused.message
        # 100 tokens short at 1000 per minute: 6 s.
        assert 5.5 < refused.retry_after_s <= 6.0
        assert (await take(limiter, tenant_id, key_id, tenant=budget, tokens=300)).allowed

    async def test_a_request_larger_than_the_minute_budget_is_refused_for_good(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        small = Limits(requests_per_minute=100, tokens_per_minute=100)
        refused = await take(limiter, tenant_id, key_id, key=small, tokens=101)
        assert not refused.allowed
        assert refused.refusal is Refusal.TOO_LARGE
        assert refused.retry_after_s == 0.0
        assert "101" in refused.message and "100" in refused.message and "max_tokens" in refused.message
        error = rate_limit_error(refused)
        assert error.status_code == 429
        assert error.code == "rate_limit_exceeded"
        assert "Retry-After" not in error.headers  # waiting would not help
        # Nothing was charged: the whole budget is still there.
        assert (await take(limiter, tenant_id, key_id, key=small, tokens=100)).allowed

    async def test_tenants_do_not_share_buckets(self, limiter: RateLimiter) -> None:
        one = Limits(requests_per_minute=1, tokens_per_minute=1_000)
        a, b = new_ids(), new_ids()
        assert (await take(limiter, *a, tenant=one)).allowed
        assert not (await take(limiter, *a, tenant=one)).allowed
        assert (await take(limiter, *b, tenant=one)).allowed


class TestAllOrNothing:
    async def test_a_key_refusal_does_not_charge_the_tenant(self, limiter: RateLimiter) -> None:
        tenant_id, key_a = new_ids()
        key_b = uuid.uuid4().hex[:16]
        tenant = Limits(requests_per_minute=3, tokens_per_minute=1_000)
        per_key = Limits(requests_per_minute=1, tokens_per_minute=1_000)
        first = await take(limiter, tenant_id, key_a, tenant=tenant, key=per_key)
        assert first.allowed
        # The key's bucket (0 left of 1) is tighter than the tenant's (2 left of 3): it is the one reported.
        assert first.headers["x-ratelimit-limit-requests"] == "1"
        assert first.headers["x-ratelimit-remaining-requests"] == "0"
        for _ in range(5):
            refused = await take(limiter, tenant_id, key_a, tenant=tenant, key=per_key)
            assert not refused.allowed
            assert "this API key" in refused.message
        # Had the refusals charged the tenant, it would be exhausted; it still has two requests.
        assert (await take(limiter, tenant_id, key_b, tenant=tenant)).allowed
        assert (await take(limiter, tenant_id, key_b, tenant=tenant)).allowed
        refused = await take(limiter, tenant_id, key_b, tenant=tenant)
        assert not refused.allowed
        assert "your organization" in refused.message

    async def test_a_tokens_refusal_does_not_charge_requests(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        limits = Limits(requests_per_minute=2, tokens_per_minute=100)
        assert (await take(limiter, tenant_id, key_id, tenant=limits, tokens=90)).allowed
        assert not (await take(limiter, tenant_id, key_id, tenant=limits, tokens=50)).allowed
        second = await take(limiter, tenant_id, key_id, tenant=limits, tokens=10)
        assert second.allowed
        assert second.headers["x-ratelimit-remaining-requests"] == "0"

    async def test_concurrent_acquires_admit_exactly_the_limit(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        five = Limits(requests_per_minute=5, tokens_per_minute=1_000)
        decisions = await asyncio.gather(*(take(limiter, tenant_id, key_id, tenant=five) for _ in range(20)))
        assert sum(d.allowed for d in decisions) == 5


class TestSharedThroughRedis:
    async def test_two_replicas_share_the_limits(self, redis_server: Any, redis_prefix: str) -> None:
        stores = [RedisStore(redis_server.url, prefix=redis_prefix) for _ in range(2)]
        try:
            one, two = (RedisRateLimiter(store) for store in stores)
            tenant_id, key_id = new_ids()
            four = Limits(requests_per_minute=4, tokens_per_minute=1_000)
            decisions = await asyncio.gather(
                *(take(replica, tenant_id, key_id, tenant=four) for replica in [one, two] * 5)
            )
            assert sum(d.allowed for d in decisions) == 4
            assert not (await take(one, tenant_id, key_id, tenant=four)).allowed
            assert not (await take(two, tenant_id, key_id, tenant=four)).allowed
        finally:
            for store in stores:
                await store.close()

    async def test_keys_live_under_the_prefix_and_expire(self, redis_server: Any, redis_prefix: str) -> None:
        store = RedisStore(redis_server.url, prefix=redis_prefix)
        try:
            tenant_id, key_id = new_ids()
            # Full again after 30 s (requests) and 6 s (tokens): that is how long each key lives.
            slow = Limits(requests_per_minute=2, tokens_per_minute=100)
            await take(RedisRateLimiter(store), tenant_id, key_id, tenant=slow, key=slow, tokens=10)
            keys = [key async for key in store.redis.scan_iter(match=f"{redis_prefix}ratelimit:*")]
            assert len(keys) == 4
            for key in keys:
                assert tenant_id in key.decode()
                expected_ms = 30_000 if key.endswith(b"requests") else 6_000
                assert expected_ms - 1_000 < await store.redis.pttl(key) <= expected_ms + 1
        finally:
            await store.close()


class TestRedisDown:
    async def test_open_policy_admits_and_counts(self) -> None:
        store = RedisStore(DEAD_REDIS, prefix="x:")
        try:
            limiter = RedisRateLimiter(store, failure_policy="open")
            decision = await take(limiter, *new_ids())
            assert decision.allowed
            assert limiter.num_unavailable == 1
        finally:
            await store.close()

    async def test_closed_policy_refuses_with_503(self) -> None:
        store = RedisStore(DEAD_REDIS, prefix="x:")
        try:
            limiter = RedisRateLimiter(store, failure_policy="closed")
            decision = await take(limiter, *new_ids())
            assert not decision.allowed
            assert decision.refusal is Refusal.UNAVAILABLE
            assert limiter.num_unavailable == 1
            error = rate_limit_error(decision)
            assert error.status_code == 503
            assert error.headers["Retry-After"] == "1"
        finally:
            await store.close()

    def test_open_rate_limiter_follows_the_store_and_the_policy(self, tmp_path: Any) -> None:
        settings = Settings(data_dir=tmp_path, ratelimit_failure_policy="closed")
        assert isinstance(open_rate_limiter(MemoryStore(), settings), MemoryRateLimiter)
        store = RedisStore(DEAD_REDIS, prefix="x:")
        limiter = open_rate_limiter(store, settings)
        assert isinstance(limiter, RedisRateLimiter)
        assert limiter._policy == "closed"


class TestErrorAndValues:
    async def test_refusal_becomes_429_with_openai_headers(self, limiter: RateLimiter) -> None:
        tenant_id, key_id = new_ids()
        one = Limits(requests_per_minute=1, tokens_per_minute=1_000)
        await take(limiter, tenant_id, key_id, tenant=one)
        refused = await take(limiter, tenant_id, key_id, tenant=one)
        error = rate_limit_error(refused)
        assert error.status_code == 429
        assert error.code == "rate_limit_exceeded"
        assert error.headers["Retry-After"] in {"59", "60"}  # whole seconds, rounded up
        assert 58_000 < int(error.headers["retry-after-ms"]) <= 60_000
        for name in ("requests", "tokens"):
            for kind in ("limit", "remaining", "reset"):
                assert f"x-ratelimit-{kind}-{name}" in error.headers

    def test_admitted_request_has_no_error(self) -> None:
        with pytest.raises(ValueError, match="admitted"):
            rate_limit_error(RateDecision(True, 0.0, {}))

    @pytest.mark.parametrize(("rpm", "tpm"), [(0, 1), (1, 0), (-5, 10)])
    def test_limits_must_be_positive(self, rpm: int, tpm: int) -> None:
        with pytest.raises(ValueError, match="at least 1"):
            Limits(requests_per_minute=rpm, tokens_per_minute=tpm)

    async def test_negative_tokens_are_a_caller_error(self, limiter: RateLimiter) -> None:
        with pytest.raises(ValueError, match="tokens"):
            await take(limiter, *new_ids(), tokens=-1)

    @pytest.mark.parametrize(
        ("seconds", "text"), [(1.5, "1.5s"), (20.0, "20s"), (0.02, "0.02s"), (0.0, "0s"), (-1.0, "0s")]
    )
    def test_reset_duration(self, seconds: float, text: str) -> None:
        assert format_duration(seconds) == text


class TestAdminSetsLimits:
    async def test_patch_sets_and_get_shows(
        self, client: Client, admin_headers: dict[str, str], make_tenant: Any
    ) -> None:
        tenant, key = await make_tenant("limited")
        assert tenant["limits"] == {
            "requests_per_minute": None,
            "tokens_per_minute": None,
            "key_requests_per_minute": None,
            "key_tokens_per_minute": None,
            "max_concurrent_requests": None,
        }
        url = f"/admin/tenants/{tenant['id']}"
        body = {"limits": {"requests_per_minute": 100, "key_tokens_per_minute": 5000}}
        response = await client.patch(url, json=body, headers=admin_headers)
        assert response.status_code == 200, response.text
        expected = {
            "requests_per_minute": 100,
            "tokens_per_minute": None,
            "key_requests_per_minute": None,
            "key_tokens_per_minute": 5000,
            "max_concurrent_requests": None,
        }
        assert response.json()["limits"] == expected
        assert (await client.get(url, headers=admin_headers)).json()["limits"] == expected
        # The tenant sees its own limits too.
        me = await client.get("/v1/me", headers={"Authorization": f"Bearer {key}"})
        assert me.json()["limits"] == expected

        # null returns one limit to the default; absent fields stay.
        response = await client.patch(url, json={"limits": {"requests_per_minute": None}}, headers=admin_headers)
        assert response.status_code == 200
        assert (await client.get(url, headers=admin_headers)).json()["limits"] == {
            **expected,
            "requests_per_minute": None,
        }

    @pytest.mark.parametrize(
        "limits",
        [{}, {"requests_per_minute": 0}, {"tokens_per_minute": -1}, {"requests_per_minute": "many"}, {"rpm": 5}],
    )
    async def test_bad_limits_are_400_and_change_nothing(
        self, client: Client, admin_headers: dict[str, str], make_tenant: Any, limits: dict[str, Any]
    ) -> None:
        tenant, _ = await make_tenant("strict")
        url = f"/admin/tenants/{tenant['id']}"
        response = await client.patch(url, json={"limits": limits}, headers=admin_headers)
        assert response.status_code == 400, response.text
        assert (await client.get(url, headers=admin_headers)).json()["limits"] == tenant["limits"]

    async def test_rename_keeps_limits(self, client: Client, admin_headers: dict[str, str], make_tenant: Any) -> None:
        tenant, _ = await make_tenant("keeps")
        url = f"/admin/tenants/{tenant['id']}"
        await client.patch(url, json={"limits": {"tokens_per_minute": 777}}, headers=admin_headers)
        response = await client.patch(url, json={"name": "kept"}, headers=admin_headers)
        assert response.json()["limits"]["tokens_per_minute"] == 777


@pytest.mark.unit
@pytest.mark.parametrize("start", [7.7, 12345.678, 0.1, 1e9 + 0.3])
async def test_a_bucket_exactly_full_again_admits_whatever_the_clock_reads(start: float) -> None:
    """(now + 60) - 60 - now is not always 0.0 in floating point (at now = 7.7 it is 2.7e-15): a budget of one
    request a minute must still admit the first request and, a minute later, the next."""
    now = [start]
    limiter = MemoryRateLimiter(clock=lambda: now[0])
    one = Limits(requests_per_minute=1, tokens_per_minute=1000)

    async def allowed() -> bool:
        decision = await limiter.acquire(tenant_id="t", key_id="k", tenant=one, key=one, tokens=1)
        return decision.allowed

    assert await allowed()
    assert not await allowed()
    now[0] += 60.0
    assert await allowed()
