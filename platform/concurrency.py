"""Per-tenant concurrency caps: how many of a tenant's requests may run at once, across every platform replica.

An admitted request holds a lease: a member of the tenant's sorted set in Redis, scored by the time it expires.
Taking one is one Lua script (clocked by Redis's TIME): drop the expired members, then admit if fewer than the cap
remain. The holder renews its lease every `ttl_s / 3` while the request runs (a streamed answer until its last
byte or its client leaving) and removes it at the end. A replica that crashes stops renewing, so its leases expire
within `ttl_s` and the slots come back on their own: nothing to clean up, no replica to ask.

`MemoryLeases` has the same semantics in this process, for the embedded mode. When Redis does not answer, the rate
limiter's failure policy decides (LORAPLEX_RATELIMIT_FAILURE_POLICY): "open" admits the request without a lease,
"closed" refuses it with 503. See docs/decisions/0027-concurrency-leases.md.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from loraplex.platform.errors import ApiError
from loraplex.platform.kv import KeyValueStore, RedisStore
from loraplex.platform.ratelimit import FailurePolicy
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)

# What a request over its tenant's cap is told to wait: a slot frees whenever any of the tenant's requests ends,
# so there is no better estimate than "soon".
OVER_CAP_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Lease:
    """One admitted request's slot. `tracked` is False for a request admitted without the shared store (failure
    policy "open"): it holds no slot anywhere, so there is nothing to renew or release."""

    tenant_id: str
    lease_id: str
    tracked: bool = True


class LeaseRefusal(enum.StrEnum):
    OVER_CAP = "over_cap"  # the tenant already has `cap` requests in flight
    UNAVAILABLE = "unavailable"  # the shared store did not answer and the failure policy is "closed"


@dataclass(frozen=True, slots=True)
class LeaseDecision:
    """The verdict on one request: `lease` when admitted, else `refusal`. `num_held`: the tenant's live leases after
    the decision (this one included; 0 when the store did not answer)."""

    cap: int
    num_held: int
    lease: Lease | None = None
    refusal: LeaseRefusal | None = None


class Leases(Protocol):
    """Take, renew and release leases. One per process; safe for concurrent requests."""

    @property
    def ttl_s(self) -> float:
        """How long a lease lives unless renewed."""
        ...

    async def acquire(self, tenant_id: str, *, cap: int) -> LeaseDecision:
        """A lease for one more request of the tenant if it has fewer than `cap` (>= 1) live ones."""
        ...

    async def renew(self, lease: Lease) -> None:
        """Push the lease's expiry to `ttl_s` from now; a lease that had expired meanwhile is taken again (its
        request is still running, so it counts), even past the cap. Never raises for a store failure (logs it)."""
        ...

    async def release(self, lease: Lease) -> None:
        """Free the slot at once. Never raises for a store failure: the lease then expires on its own."""
        ...


def concurrency_error(decision: LeaseDecision) -> ApiError:
    """The error a refused request answers with: 429 `concurrency_limit_exceeded` with Retry-After, or 503 when the
    store could not decide and the policy is to refuse."""
    if decision.refusal is LeaseRefusal.UNAVAILABLE:
        message = "The concurrency limiter is unavailable; the request was not run. Please try again shortly."
        return ApiError(503, message, code="concurrency_limiter_unavailable", headers={"Retry-After": "1"})
    if decision.refusal is not LeaseRefusal.OVER_CAP:
        raise ValueError("concurrency_error of an admitted request")
    message = (
        f"Too many concurrent requests for your organization: at most {decision.cap} may run at once. "
        "Please retry when one of them has finished."
    )
    headers = {
        "Retry-After": str(OVER_CAP_RETRY_AFTER_S),
        "retry-after-ms": str(OVER_CAP_RETRY_AFTER_S * 1000),  # what OpenAI's SDKs read first
    }
    return ApiError(429, message, code="concurrency_limit_exceeded", headers=headers)


def new_lease_id() -> str:
    return secrets.token_hex(12)


def decision(tenant_id: str, cap: int, lease_id: str, admitted: int, held: int) -> LeaseDecision:
    """The verdict from `acquire_lease`'s result."""
    if admitted != 1:
        return LeaseDecision(cap, held, refusal=LeaseRefusal.OVER_CAP)
    return LeaseDecision(cap, held, lease=Lease(tenant_id, lease_id))


def check_cap(cap: int) -> None:
    if cap < 1:
        raise ValueError(f"a concurrency cap must be at least 1, got {cap}")


# ---------------------------------------------------------------------------------------------------------------
# Redis


# Taking a lease, as a Lua function that the leases' own script and the admission script (admission.py: limits and
# lease in one round trip) both call. acquire_lease(key, now (ms), ttl (ms), cap, lease id): drops the expired
# members, admits if fewer than `cap` remain. Returns {admitted (0|1), leases held after}. The key's own expiry is
# pushed to the newest lease's: a tenant gone idle leaves nothing behind.
ACQUIRE_LUA_FUNCTION = """
local function acquire_lease(key, now, ttl, cap, lease_id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local held = redis.call('ZCARD', key)
  if held >= cap then
    return {0, held}
  end
  redis.call('ZADD', key, now + ttl, lease_id)
  redis.call('PEXPIRE', key, ttl)
  return {1, held + 1}
end
"""

# KEYS[1]: the tenant's lease set. ARGV: ttl (ms), cap, lease id.
_ACQUIRE_LUA = (
    ACQUIRE_LUA_FUNCTION
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return acquire_lease(KEYS[1], now, tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3])
"""
)

# KEYS[1]: the tenant's lease set. ARGV: ttl (ms), lease id. Returns 1 when the lease had expired (taken again).
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local added = redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl)
return added
"""

_REDIS_FAILURES = (RedisError, OSError, TimeoutError)


class RedisLeases:
    """Leases in Redis, shared by every replica: the sorted set `concurrency:{<tenant>}` under the store's prefix
    (member: lease id, score: expiry in Redis's clock, ms)."""

    def __init__(self, store: RedisStore, *, ttl_s: float = 30.0, failure_policy: FailurePolicy = "open") -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._store = store
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._policy: FailurePolicy = failure_policy
        self._acquire = store.redis.register_script(_ACQUIRE_LUA)
        self._renew = store.redis.register_script(_RENEW_LUA)

    @property
    def ttl_s(self) -> float:
        return self._ttl_ms / 1000

    @property
    def ttl_ms(self) -> int:
        return self._ttl_ms

    def key(self, tenant_id: str) -> str:
        """The tenant's lease set."""
        return self._store.key(f"concurrency:{{{tenant_id}}}")

    async def acquire(self, tenant_id: str, *, cap: int) -> LeaseDecision:
        check_cap(cap)
        lease_id = new_lease_id()
        try:
            admitted, held = await self._acquire(keys=[self.key(tenant_id)], args=[self._ttl_ms, cap, lease_id])
        except _REDIS_FAILURES:
            return self.unavailable(tenant_id, cap, lease_id)
        return decision(tenant_id, cap, lease_id, int(admitted), int(held))

    def unavailable(self, tenant_id: str, cap: int, lease_id: str) -> LeaseDecision:
        """The decision when Redis did not answer: the failure policy's (call from the `except` that caught it)."""
        logger.warning(
            "concurrency limiter: Redis unreachable; policy %r %s the request",
            self._policy,
            "admits" if self._policy == "open" else "refuses",
            exc_info=True,
        )
        if self._policy == "open":
            return LeaseDecision(cap, 0, lease=Lease(tenant_id, lease_id, tracked=False))
        return LeaseDecision(cap, 0, refusal=LeaseRefusal.UNAVAILABLE)

    async def renew(self, lease: Lease) -> None:
        if not lease.tracked:
            return
        try:
            lost = await self._renew(keys=[self.key(lease.tenant_id)], args=[self._ttl_ms, lease.lease_id])
        except _REDIS_FAILURES:
            logger.warning("concurrency limiter: Redis unreachable; lease %s not renewed", lease.lease_id)
            return
        if int(lost):
            logger.warning("lease %s of tenant %s had expired; taken again", lease.lease_id, lease.tenant_id)

    async def release(self, lease: Lease) -> None:
        if not lease.tracked:
            return
        try:
            await self._store.redis.zrem(self.key(lease.tenant_id), lease.lease_id)
        except _REDIS_FAILURES:
            logger.warning("concurrency limiter: Redis unreachable; lease %s expires on its own", lease.lease_id)


# ---------------------------------------------------------------------------------------------------------------
# In process


class MemoryLeases:
    """The same leases in this process's memory: correct only while one process serves (the embedded mode).
    `clock` is monotonic seconds."""

    def __init__(self, *, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._expiries: dict[str, dict[str, float]] = {}  # tenant id -> lease id -> expiry, in `clock` seconds

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    async def acquire(self, tenant_id: str, *, cap: int) -> LeaseDecision:
        check_cap(cap)
        # No await between reading and writing: atomic within the event loop.
        now = self._clock()
        live = {i: expiry for i, expiry in self._expiries.get(tenant_id, {}).items() if expiry > now}
        if len(live) >= cap:
            self._expiries[tenant_id] = live
            return LeaseDecision(cap, len(live), refusal=LeaseRefusal.OVER_CAP)
        lease = Lease(tenant_id, new_lease_id())
        live[lease.lease_id] = now + self._ttl_s
        self._expiries[tenant_id] = live
        return LeaseDecision(cap, len(live), lease=lease)

    async def renew(self, lease: Lease) -> None:
        leases = self._expiries.setdefault(lease.tenant_id, {})
        now = self._clock()
        expiry = leases.get(lease.lease_id)
        if expiry is None or expiry <= now:
            logger.warning("lease %s of tenant %s had expired; taken again", lease.lease_id, lease.tenant_id)
        leases[lease.lease_id] = now + self._ttl_s

    async def release(self, lease: Lease) -> None:
        leases = self._expiries.get(lease.tenant_id)
        if leases is None:
            return
        leases.pop(lease.lease_id, None)
        if not leases:
            del self._expiries[lease.tenant_id]


def open_leases(kv: KeyValueStore, settings: Settings) -> Leases:
    """Redis leases when the key-value store is Redis (shared by replicas), else the in-process ones."""
    ttl_s = settings.concurrency_lease_ttl_s
    if isinstance(kv, RedisStore):
        return RedisLeases(kv, ttl_s=ttl_s, failure_policy=settings.ratelimit_failure_policy)
    return MemoryLeases(ttl_s=ttl_s)


# ---------------------------------------------------------------------------------------------------------------
# Holding one


class HeldLease:
    """An admitted request's lease, renewed in the background from construction until `release()`, which the
    request's owner calls once it has ended (idempotent). Construct it inside a running event loop.

    Renewals are timers of the event loop that start a renewal only when one is due (most requests end long
    before): a timer refers to its holder only weakly, so a holder dropped without `release()` (a response object
    discarded before it was ever sent) stops the renewals, and the lease expires within `ttl_s` instead of living
    as long as the process.
    """

    def __init__(self, leases: Leases, lease: Lease) -> None:
        self._leases = leases
        self.lease = lease
        self._released = False
        self._timer: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task[None] | None = None
        if lease.tracked:
            self._schedule_renewal()

    async def release(self) -> None:
        """Stop renewing and free the slot; shielded, so a cancelled request (its client gone) still frees it."""
        if self._stop():
            await asyncio.shield(self._leases.release(self.lease))

    def release_soon(self) -> asyncio.Task[None] | None:
        """Stop renewing now and free the slot in a task of its own (None when released already): for an answer
        that must not wait for the store. The caller keeps the task until it is done (the loop holds tasks only
        weakly); a release that fails or never runs (the process ends) leaves the lease to expire within `ttl_s`."""
        if not self._stop():
            return None
        return asyncio.ensure_future(self._leases.release(self.lease))

    def _stop(self) -> bool:
        """Stop the renewals; whether this was the first release."""
        if self._released:
            return False
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
        if self._renewal is not None:
            self._renewal.cancel()
        return True

    def _schedule_renewal(self) -> None:
        interval_s = self._leases.ttl_s / 3  # two renewals may fail (a Redis blip) before the lease expires
        holder = weakref.ref(self)
        self._timer = asyncio.get_running_loop().call_later(interval_s, _renewal_due, holder, self.lease)

    async def _renew(self) -> None:
        try:
            await self._leases.renew(self.lease)
        except Exception:  # renew never raises by contract; the renewals must outlive whatever one of them met
            logger.exception("lease %s could not be renewed", self.lease.lease_id)
        if not self._released:
            self._schedule_renewal()


def _renewal_due(holder: weakref.ref[HeldLease], lease: Lease) -> None:
    held = holder()
    if held is None:
        logger.warning("lease %s was dropped without a release; it expires on its own", lease.lease_id)
        return
    held._renewal = asyncio.ensure_future(held._renew())
