"""Per-tenant and per-key rate limits: requests per minute and tokens per minute, admitted all-or-nothing.

Each limit is a GCRA bucket (generic cell rate algorithm): one stored number per bucket, the theoretical arrival
time (TAT). A bucket of `limit` units per minute emits one unit every `60 s / limit` and tolerates a burst of the
whole minute's budget. A request costs 1 in each requests bucket and its estimated tokens (prompt + max_tokens,
passed by the caller) in each tokens bucket; it is admitted only if all four buckets (tenant requests, tenant
tokens, key requests, key tokens) admit it, and then all four are charged. A refused request charges nothing.

`RedisRateLimiter` keeps the buckets in Redis and decides in one Lua script (atomic, clocked by Redis's TIME), so
every platform replica shares the limits. `MemoryRateLimiter` has the same semantics in process, for the embedded
single-process mode. See docs/decisions/0009-rate-limits.md.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis.exceptions import RedisError

from loraplex.platform.errors import ApiError
from loraplex.platform.kv import KeyValueStore, RedisStore
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)

PERIOD_S = 60.0
_PERIOD_US = 60_000_000

FailurePolicy = Literal["open", "closed"]


@dataclass(frozen=True)
class Limits:
    """Per-minute budgets of one tenant or one API key; both at least 1."""

    requests_per_minute: int
    tokens_per_minute: int

    def __post_init__(self) -> None:
        if self.requests_per_minute < 1 or self.tokens_per_minute < 1:
            raise ValueError(f"rate limits must be at least 1 per minute, got {self}")


class Refusal(enum.StrEnum):
    RATE_LIMITED = "rate_limited"  # over a budget now; admitted after retry_after_s
    TOO_LARGE = "too_large"  # the request alone costs more than a whole minute's budget: waiting never helps
    UNAVAILABLE = "unavailable"  # the shared store did not answer and the failure policy is "closed"


@dataclass(frozen=True)
class RateDecision:
    """The verdict on one request.

    `retry_after_s`: seconds until the same request would be admitted (0 when admitted, and when it never would be:
    `refusal` TOO_LARGE). `headers`: OpenAI's x-ratelimit-* headers, each from the tighter of tenant and key.
    """

    allowed: bool
    retry_after_s: float
    headers: dict[str, str]
    refusal: Refusal | None = None
    message: str = ""  # why it was refused, in the client's words; empty when admitted


class RateLimiter(Protocol):
    num_unavailable: int  # decisions made without the shared store (by the failure policy), for metrics

    async def acquire(self, *, tenant_id: str, key_id: str, tenant: Limits, key: Limits, tokens: int) -> RateDecision:
        """Admit a request costing 1 request and `tokens` tokens against the tenant's and the key's limits."""
        ...


def rate_limit_error(decision: RateDecision) -> ApiError:
    """The error a refused request answers with: 429 (OpenAI's `rate_limit_exceeded`, with Retry-After when waiting
    helps) or 503 when the limiter could not decide and the policy is to refuse."""
    if decision.allowed:
        raise ValueError("rate_limit_error of an admitted request")
    headers = dict(decision.headers)
    if decision.refusal is Refusal.UNAVAILABLE:
        return ApiError(503, decision.message, code="rate_limiter_unavailable", headers={"Retry-After": "1"})
    if decision.refusal is Refusal.RATE_LIMITED:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(decision.retry_after_s * 1000)))
    return ApiError(429, decision.message, code="rate_limit_exceeded", headers=headers)


# ---------------------------------------------------------------------------------------------------------------
# The decision, shared by both implementations: bucket states in, RateDecision out.


class _Unit(enum.StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class _Bucket:
    """One of the four buckets of a request, before the decision."""

    owner: Literal["tenant", "key"]
    unit: _Unit
    limit: int  # units per minute
    cost: int  # units this request takes


@dataclass(frozen=True, slots=True)
class _BucketResult:
    admits: bool  # this bucket alone would admit the request
    retry_after_s: float  # until this bucket admits it (0 when it does)
    remaining: int  # units still available after this decision
    reset_s: float  # until this bucket is full again, after this decision


def _buckets(tenant: Limits, key: Limits, tokens: int) -> tuple[_Bucket, _Bucket, _Bucket, _Bucket]:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return (
        _Bucket("tenant", _Unit.REQUESTS, tenant.requests_per_minute, 1),
        _Bucket("tenant", _Unit.TOKENS, tenant.tokens_per_minute, tokens),
        _Bucket("key", _Unit.REQUESTS, key.requests_per_minute, 1),
        _Bucket("key", _Unit.TOKENS, key.tokens_per_minute, tokens),
    )


def format_duration(seconds: float) -> str:
    """`1.5s`, `20s`, `0.02s`: how OpenAI's x-ratelimit-reset-* headers read (a Go duration)."""
    text = f"{max(0.0, seconds):.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _headers(buckets: Sequence[_Bucket], results: Sequence[_BucketResult]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for unit in _Unit:
        pairs = [(b, r) for b, r in zip(buckets, results, strict=True) if b.unit is unit]
        # The tighter bucket is the one with fewer units left (on a tie: the one that takes longer to refill).
        bucket, result = min(pairs, key=lambda pair: (pair[1].remaining, -pair[1].reset_s))
        headers[f"x-ratelimit-limit-{unit}"] = str(bucket.limit)
        headers[f"x-ratelimit-remaining-{unit}"] = str(result.remaining)
        headers[f"x-ratelimit-reset-{unit}"] = format_duration(result.reset_s)
    return headers


def _decide(buckets: Sequence[_Bucket], results: Sequence[_BucketResult]) -> RateDecision:
    headers = _headers(buckets, results)
    too_large = [b for b in buckets if b.cost > b.limit]
    if too_large:
        bucket = too_large[0]
        whose = "your organization" if bucket.owner == "tenant" else "this API key"
        message = (
            f"Request too large: it needs up to {bucket.cost} {bucket.unit} (prompt tokens + max_tokens) but the "
            f"limit of {whose} is {bucket.limit} {bucket.unit} per minute. Reduce the prompt or max_tokens."
        )
        return RateDecision(False, 0.0, headers, Refusal.TOO_LARGE, message)
    refused = [(b, r) for b, r in zip(buckets, results, strict=True) if not r.admits]
    if not refused:
        return RateDecision(True, 0.0, headers)
    # Nothing was charged, so the request passes once the slowest refusing bucket has refilled enough.
    bucket, result = max(refused, key=lambda pair: pair[1].retry_after_s)
    whose = "your organization" if bucket.owner == "tenant" else "this API key"
    message = (
        f"Rate limit reached for {bucket.unit} per minute of {whose}: limit {bucket.limit}, "
        f"requested {bucket.cost}. Please try again in {format_duration(result.retry_after_s)}."
    )
    return RateDecision(False, result.retry_after_s, headers, Refusal.RATE_LIMITED, message)


def _unavailable(policy: FailurePolicy) -> RateDecision:
    if policy == "open":
        return RateDecision(True, 0.0, {})
    message = "The rate limiter is unavailable; the request was not run. Please try again shortly."
    return RateDecision(False, 0.0, {}, Refusal.UNAVAILABLE, message)


# ---------------------------------------------------------------------------------------------------------------
# Redis


# The decision on a request's buckets, as a Lua function that the rate limiter's own script and the admission script
# (admission.py: limits and lease in one round trip) both call. gcra(keys, k0, argv, a0, n, now): the buckets are
# keys[k0 + 1 .. k0 + n]; argv[a0 + 1] is the period (us), then limit and cost of each bucket in keys' order; `now` in
# us. Charges every bucket or none. Returns whether all admit, and per bucket {admits, retry_after_us, remaining,
# reset_us}, integers (Redis truncates Lua numbers).
GCRA_LUA_FUNCTION = """
local function gcra(keys, k0, argv, a0, n, now)
  local period = tonumber(argv[a0 + 1])
  local tats, new_tats, intervals = {}, {}, {}
  local all = true
  local out = {}
  for i = 1, n do
    local limit = tonumber(argv[a0 + 2 * i])
    local cost = tonumber(argv[a0 + 2 * i + 1])
    local interval = period / limit
    local tat = tonumber(redis.call('GET', keys[k0 + i])) or now
    if tat < now then tat = now end
    local new_tat = tat + cost * interval
    local allow_at = new_tat - period
    tats[i], new_tats[i], intervals[i] = tat, new_tat, interval
    if allow_at > now + 1 then  -- 1 us of slack: doubles near 1.7e15 us round to a quarter microsecond
      all = false
      out[i] = {0, math.ceil(allow_at - now)}
    else
      out[i] = {1, 0}
    end
  end
  local result = {}
  for i = 1, n do
    local tat = tats[i]
    if all then
      tat = new_tats[i]
      if tat > now then
        redis.call('SET', keys[k0 + i], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
      end
    end
    local remaining = math.floor((now + period - tat) / intervals[i] + 1e-9)
    if remaining < 0 then remaining = 0 end
    table.insert(result, out[i][1])
    table.insert(result, out[i][2])
    table.insert(result, remaining)
    table.insert(result, math.ceil(tat - now))
  end
  return all, result
end
"""

# KEYS: the four bucket keys. ARGV: as gcra's. TIME makes the script non-deterministic, which Redis >= 5 replicates
# by effects.
_GCRA_LUA = (
    GCRA_LUA_FUNCTION
    + """
local t = redis.call('TIME')
local _, result = gcra(KEYS, 0, ARGV, 0, #KEYS, tonumber(t[1]) * 1000000 + tonumber(t[2]))
return result
"""
)


class RedisRateLimiter:
    """Buckets in Redis, shared by every replica; keys `ratelimit:{<tenant>}:...` under the store's prefix (the
    hash tag keeps a request's four keys in one Redis Cluster slot), each expiring once its bucket is full again.

    When Redis does not answer, `failure_policy` decides: "open" admits (and counts it in `num_unavailable`),
    "closed" refuses with 503. One per process; safe for concurrent requests.
    """

    def __init__(self, store: RedisStore, *, failure_policy: FailurePolicy = "open") -> None:
        self._store = store
        self._script = store.redis.register_script(_GCRA_LUA)
        self._policy: FailurePolicy = failure_policy
        self.num_unavailable = 0  # decisions made without Redis, by the failure policy

    @property
    def store(self) -> RedisStore:
        return self._store

    def script_keys(self, tenant_id: str, key_id: str) -> list[str]:
        """The four bucket keys of a request, in `gcra`'s order."""
        base = f"ratelimit:{{{tenant_id}}}"
        return [
            self._store.key(f"{base}:requests"),
            self._store.key(f"{base}:tokens"),
            self._store.key(f"{base}:key:{key_id}:requests"),
            self._store.key(f"{base}:key:{key_id}:tokens"),
        ]

    async def acquire(self, *, tenant_id: str, key_id: str, tenant: Limits, key: Limits, tokens: int) -> RateDecision:
        buckets = Buckets.of(tenant, key, tokens)
        try:
            raw = await self._script(keys=self.script_keys(tenant_id, key_id), args=buckets.script_args())
        except (RedisError, OSError, TimeoutError):
            return self.unavailable()
        return buckets.decision(raw)

    def unavailable(self) -> RateDecision:
        """The decision when Redis did not answer: the failure policy's, counted in `num_unavailable`."""
        self.num_unavailable += 1
        logger.warning(
            "rate limiter: Redis unreachable; policy %r %s the request",
            self._policy,
            "admits" if self._policy == "open" else "refuses",
            exc_info=True,
        )
        return _unavailable(self._policy)


@dataclass(frozen=True, slots=True)
class Buckets:
    """The four buckets of one request, for a script that runs `gcra` on them: its arguments, and the decision from
    its result."""

    buckets: tuple[_Bucket, _Bucket, _Bucket, _Bucket]

    @classmethod
    def of(cls, tenant: Limits, key: Limits, tokens: int) -> Buckets:
        return cls(_buckets(tenant, key, tokens))

    @property
    def too_large(self) -> bool:
        """The request costs more than some bucket's whole minute: refused whatever the buckets hold."""
        return any(b.cost > b.limit for b in self.buckets)

    def script_args(self) -> list[int]:
        """`gcra`'s arguments: the period, then limit and cost of each bucket."""
        args: list[int] = [_PERIOD_US]
        for bucket in self.buckets:
            args += [bucket.limit, bucket.cost]
        return args

    def decision(self, raw: Sequence[Any]) -> RateDecision:
        """The verdict from `gcra`'s per-bucket result."""
        values = [int(v) for v in raw]
        results = [
            _BucketResult(
                admits=values[i] == 1,
                retry_after_s=values[i + 1] / 1e6,
                remaining=values[i + 2],
                reset_s=values[i + 3] / 1e6,
            )
            for i in range(0, len(values), 4)
        ]
        return _decide(self.buckets, results)


# ---------------------------------------------------------------------------------------------------------------
# In process


# A bucket that is exactly full again admits: without slack, (now + 60) - 60 - now can come out a hair above zero.
_SLACK_S = 1e-6


class MemoryRateLimiter:
    """The same buckets in this process's memory: correct only while one process serves (the embedded mode).

    `clock` is monotonic seconds. Buckets that are full again are forgotten every `sweep_every` decisions.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, sweep_every: int = 1024) -> None:
        self._clock = clock
        self._sweep_every = sweep_every
        self._tats: dict[str, float] = {}  # bucket name -> theoretical arrival time, in `clock` seconds
        self._num_decisions = 0
        self.num_unavailable = 0  # always 0 (memory does not fail); here so both implementations have the counter

    async def acquire(self, *, tenant_id: str, key_id: str, tenant: Limits, key: Limits, tokens: int) -> RateDecision:
        # No await between reading and writing the buckets: atomic within the event loop.
        buckets = _buckets(tenant, key, tokens)
        names = [
            f"{tenant_id}:requests",
            f"{tenant_id}:tokens",
            f"{tenant_id}:key:{key_id}:requests",
            f"{tenant_id}:key:{key_id}:tokens",
        ]
        now = self._clock()
        tats: list[float] = []
        new_tats: list[float] = []
        retry: list[float] = []
        for name, bucket in zip(names, buckets, strict=True):
            tat = max(self._tats.get(name, now), now)
            new_tat = tat + bucket.cost * PERIOD_S / bucket.limit
            tats.append(tat)
            new_tats.append(new_tat)
            wait = new_tat - PERIOD_S - now
            retry.append(wait if wait > _SLACK_S else 0.0)  # float sums of `now` are not exact
        admitted = all(r == 0.0 for r in retry)
        if admitted:
            for name, new_tat in zip(names, new_tats, strict=True):
                self._tats[name] = new_tat
            tats = new_tats
        results = [
            _BucketResult(
                admits=r == 0.0,
                retry_after_s=r,
                remaining=max(0, math.floor((now + PERIOD_S - tat) * bucket.limit / PERIOD_S + 1e-9)),
                reset_s=tat - now,
            )
            for bucket, tat, r in zip(buckets, tats, retry, strict=True)
        ]
        self._num_decisions += 1
        if self._num_decisions % self._sweep_every == 0:
            self._tats = {name: tat for name, tat in self._tats.items() if tat > now}
        return _decide(buckets, results)


def open_rate_limiter(kv: KeyValueStore, settings: Settings) -> RateLimiter:
    """Redis buckets when the key-value store is Redis (shared by replicas), else the in-process limiter."""
    if isinstance(kv, RedisStore):
        return RedisRateLimiter(kv, failure_policy=settings.ratelimit_failure_policy)
    return MemoryRateLimiter()
