"""Admitting a completion: its rate limits and its tenant's concurrency lease, decided together with a read of the
configuration generation, in one round trip to the shared store (decision 0038).

The rules are those of the rate limiter (decision 0009) and the leases (decision 0027), unchanged: the four GCRA
buckets admit all-or-nothing; only a request they admit (and that is not too large for them) asks for a lease; a
lease refused leaves the buckets charged, as when the two were asked one after the other. In Redis, one Lua script
runs the rate limiter's and the leases' own Lua functions (`GCRA_LUA_FUNCTION`, `ACQUIRE_LUA_FUNCTION`) after
reading the generation of decision 0035. Given the generation the request's cached lookups were made in, the script
decides and charges nothing when the store holds another one (`Admission.stale`): the caller then looks again, as a
request that read the generation first would have, and asks again. Redis unreachable: the failure policy decides,
as it did for each of the two, and the generation is unknown (`Admission.generation` None).

`Admitter` is what a request calls: it counts the decisions in the process's metrics and releases leases in tasks
of their own (`release_soon`), which a later admission of the same tenant in this process waits for, so that a
client that sends its next request as soon as it has its answer finds its slot free.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from loraplex.platform.concurrency import (
    ACQUIRE_LUA_FUNCTION,
    HeldLease,
    LeaseDecision,
    Leases,
    RedisLeases,
    check_cap,
    decision,
    new_lease_id,
)
from loraplex.platform.config_cache import GENERATION_KEY, ConfigCache, new_token
from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.ratelimit import GCRA_LUA_FUNCTION, Buckets, Limits, RateDecision, RateLimiter, RedisRateLimiter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict on one request. `generation`: the configuration generation read in the same round trip (None:
    the store could not be read). `stale`: it was not the generation the request expected, and nothing was decided
    or charged (`rate` and `lease` None). Else `rate` is the rate limiter's decision and `lease` the leases' (None
    when the rate limiter refused: no lease was asked for)."""

    generation: bytes | None
    rate: RateDecision | None = None
    lease: LeaseDecision | None = None

    @property
    def stale(self) -> bool:
        return self.rate is None


class Gate(Protocol):
    async def admit(
        self,
        *,
        tenant_id: str,
        key_id: str,
        tenant: Limits,
        key: Limits,
        tokens: int,
        cap: int,
        generation: bytes | None,
    ) -> Admission:
        """Decide on a request costing 1 request and `tokens` tokens, against the tenant's and the key's limits and
        the tenant's concurrency `cap`, if the configuration generation is `generation` (None: whatever it is)."""
        ...


# KEYS: the generation, the four bucket keys (gcra's order), the tenant's lease set. ARGV: [1] the expected
# generation ('' for any), [2] a new generation to start if the store has none, [3] '1' if the request may take a
# lease when the buckets admit it ('0': too large for them), [4] lease ttl (ms), [5] cap, [6] lease id, [7..]
# gcra's arguments. Returns {generation, 0} when stale; else {generation, 1, gcra's result} and, if a lease was
# asked for, its {admitted, held} after them. The generation key is outside the tenant's hash slot: this script
# assumes one Redis (see decision 0038 for a Cluster).
_ADMIT_LUA = (
    GCRA_LUA_FUNCTION
    + ACQUIRE_LUA_FUNCTION
    + """
local generation = redis.call('GET', KEYS[1])
if not generation then
  generation = ARGV[2]
  redis.call('SET', KEYS[1], generation)
end
if ARGV[1] ~= '' and generation ~= ARGV[1] then
  return {generation, 0}
end
local t = redis.call('TIME')
local all, rate = gcra(KEYS, 1, ARGV, 6, 4, tonumber(t[1]) * 1000000 + tonumber(t[2]))
if not all or ARGV[3] ~= '1' then
  return {generation, 1, rate}
end
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = acquire_lease(KEYS[6], now_ms, tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6])
return {generation, 1, rate, lease[1], lease[2]}
"""
)


class RedisGate:
    """The rate limiter's buckets and the leases' sets in Redis (their keys and policies), decided by one script."""

    def __init__(self, limiter: RedisRateLimiter, leases: RedisLeases) -> None:
        self._limiter = limiter
        self._leases = leases
        self._store = limiter.store
        self._script = self._store.redis.register_script(_ADMIT_LUA)

    async def admit(
        self,
        *,
        tenant_id: str,
        key_id: str,
        tenant: Limits,
        key: Limits,
        tokens: int,
        cap: int,
        generation: bytes | None,
    ) -> Admission:
        check_cap(cap)
        buckets = Buckets.of(tenant, key, tokens)
        lease_id = new_lease_id()
        keys = [
            self._store.key(GENERATION_KEY),
            *self._limiter.script_keys(tenant_id, key_id),
            self._leases.key(tenant_id),
        ]
        lease_args = [b"0" if buckets.too_large else b"1", self._leases.ttl_ms, cap, lease_id]
        args = [generation or b"", new_token(), *lease_args, *buckets.script_args()]
        try:
            raw = await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError):
            rate = self._limiter.unavailable()
            lease = self._leases.unavailable(tenant_id, cap, lease_id) if rate.allowed else None
            return Admission(None, rate, lease)
        token = raw[0].encode() if isinstance(raw[0], str) else raw[0]
        if int(raw[1]) == 0:
            return Admission(token)
        rate = buckets.decision(raw[2])
        lease = decision(tenant_id, cap, lease_id, int(raw[3]), int(raw[4])) if len(raw) > 3 else None
        return Admission(token, rate, lease)


class SequentialGate:
    """The same decisions asked one after the other: for the in-process limiter and leases (the embedded mode,
    where each is atomic within the event loop and nothing is a round trip)."""

    def __init__(self, cache: ConfigCache, limiter: RateLimiter, leases: Leases) -> None:
        self._cache = cache
        self._limiter = limiter
        self._leases = leases

    async def admit(
        self,
        *,
        tenant_id: str,
        key_id: str,
        tenant: Limits,
        key: Limits,
        tokens: int,
        cap: int,
        generation: bytes | None,
    ) -> Admission:
        check_cap(cap)
        token = await self._cache.read_generation()
        if generation is not None and token != generation:
            return Admission(token)
        rate = await self._limiter.acquire(tenant_id=tenant_id, key_id=key_id, tenant=tenant, key=key, tokens=tokens)
        if not rate.allowed:
            return Admission(token, rate)
        return Admission(token, rate, await self._leases.acquire(tenant_id, cap=cap))


def open_gate(cache: ConfigCache, limiter: RateLimiter, leases: Leases) -> Gate:
    """One script when both the limiter and the leases are Redis's, else one after the other."""
    if isinstance(limiter, RedisRateLimiter) and isinstance(leases, RedisLeases):
        return RedisGate(limiter, leases)
    return SequentialGate(cache, limiter, leases)


class Admitter:
    """Admissions and lease releases of this process's completions; one per process. `gate` decides with the
    uncounted limiter and leases: the decisions are counted here, the releases by the counting leases (`leases` of
    the process's resources) the callers release through."""

    def __init__(self, gate: Gate, metrics: PlatformMetrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self._releasing: dict[str, set[asyncio.Task[None]]] = {}  # tenant id -> releases in flight

    async def admit(
        self,
        *,
        tenant_id: str,
        key_id: str,
        tenant: Limits,
        key: Limits,
        tokens: int,
        cap: int,
        generation: bytes | None,
    ) -> Admission:
        """The gate's verdict (see `Gate.admit`), once this process's releases of the tenant's leases are done."""
        releasing = self._releasing.get(tenant_id)
        if releasing:
            await asyncio.wait(set(releasing))  # never cancels them, even if this request is cancelled
        admission = await self._gate.admit(
            tenant_id=tenant_id, key_id=key_id, tenant=tenant, key=key, tokens=tokens, cap=cap, generation=generation
        )
        if admission.rate is not None:
            self._metrics.count_refusal(tenant_id, admission.rate)
        if admission.lease is not None:
            self._metrics.count_lease(tenant_id, admission.lease)
        return admission

    def release_soon(self, held: HeldLease) -> None:
        """Release `held` without waiting for the store (see `HeldLease.release_soon`); the task is kept until done."""
        task = held.release_soon()
        if task is None:
            return
        tenant_id = held.lease.tenant_id
        self._releasing.setdefault(tenant_id, set()).add(task)

        def done(finished: asyncio.Task[None]) -> None:
            if not finished.cancelled() and finished.exception() is not None:  # release never raises by contract
                logger.error("lease %s could not be released", held.lease.lease_id, exc_info=finished.exception())
            releasing = self._releasing.get(tenant_id)
            if releasing is not None:
                releasing.discard(finished)
                if not releasing:
                    del self._releasing[tenant_id]

        task.add_done_callback(done)

    async def settled(self) -> None:
        """Wait for every release in flight (at shutdown, and in tests)."""
        tasks = {t for releasing in self._releasing.values() for t in releasing}
        if tasks:
            await asyncio.wait(tasks)
