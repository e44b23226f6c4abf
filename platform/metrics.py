"""Prometheus metrics of one platform process, served at GET /metrics.

Each `Resources` owns a `PlatformMetrics` with its own registry (never prometheus_client's global one), as the engine
does, so two apps in one process, as in tests, never share or double-register series. Usage counters are counted
where usage is recorded (`completions.service.record_usage`, once per request, whatever became of it), so they
count what is billed; rate-limit refusals are counted by `CountingRateLimiter` around the process's limiter, and
concurrency leases (held now, refused) by `CountingLeases` around its leases; requests no engine would queue
(every replica tried answered 503 overloaded) are counted where the relay gives up. The limiter's and the usage
recorder's own counters are read when scraped.

Labels and cardinality: `tenant` is the tenant's id and `adapter` the adapter's id ("" for a base model), both
UUIDs, never names. Names are chosen by tenants (any text, renamed at will, and not ours to publish), ids are stable
and say nothing by themselves. A series exists only once a tenant (or a tenant's adapter) has had a request in this
process, so the number of series is bounded by the pairs actually used since the process started: per tenant,
(adapters in use + 1) for each token counter, times the few statuses (ok, length, error, cancelled) for requests.
That is fine for thousands of active adapters; a deployment with far more should aggregate in its recording rules
(`sum by (tenant)`), or drop the adapter label at scrape time. The admission series (in flight, refusals) are per
tenant only; `replica` is an engine's registry id, of which a fleet has few.

What is served is aggregate numbers only: no names, keys, prompts or prices, but per tenant, which is still the
deployment's business: the endpoint needs the admin credential (the app mounts it behind the admin guard; a
Prometheus job sends an admin key as its bearer token).
"""

from __future__ import annotations

from collections.abc import Iterable

from litestar import Controller, Response, get
from litestar.datastructures import State
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.platform.concurrency import Lease, LeaseDecision, LeaseRefusal, Leases
from loraplex.platform.domain.usage.recorder import UsageEvent, UsageRecorder
from loraplex.platform.ratelimit import Limits, RateDecision, RateLimiter

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format every Prometheus version scrapes

_PREFIX = "loraplex_platform"


class _ReadAtScrape(Collector):
    """Counters other objects keep (the rate limiter's, the usage recorder's), read when scraped."""

    def __init__(self, rate_limiter: RateLimiter, usage: UsageRecorder) -> None:
        self._rate_limiter = rate_limiter
        self._usage = usage

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            f"{_PREFIX}_ratelimit_unavailable",
            "Rate-limit decisions made without the shared store (by the failure policy: admitted if open).",
            self._rate_limiter.num_unavailable,
        )
        yield CounterMetricFamily(
            f"{_PREFIX}_usage_deferred",
            "Usage events written to an outbox because the database write failed (drained later).",
            self._usage.num_deferred,
        )
        yield CounterMetricFamily(
            f"{_PREFIX}_usage_lost",
            "Usage events no database and no outbox would take (each logged in full at error level).",
            self._usage.num_lost,
        )


class PlatformMetrics:
    """The series of one platform process. Safe from the event loop (prometheus_client's counters lock)."""

    def __init__(self, rate_limiter: RateLimiter, usage: UsageRecorder) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["tenant", "adapter", "service_tier"]
        self.requests = Counter(
            f"{_PREFIX}_requests",
            "Completion requests with a usage row, by tenant id, adapter id ('' for a base model), service tier and "
            "status (ok, length, error, cancelled).",
            [*labels, "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{_PREFIX}_prompt_tokens",
            "Prompt tokens billed (cached ones included), by tenant id, adapter id and service tier.",
            labels,
            registry=self.registry,
        )
        # Prefix-cache hit rate per tenant or adapter = cached_prompt_tokens / prompt_tokens, summed by that label.
        self.cached_prompt_tokens = Counter(
            f"{_PREFIX}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache (billed at the cached price), by tenant, adapter and tier.",
            labels,
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            f"{_PREFIX}_completion_tokens",
            "Completion tokens billed (reasoning tokens included), by tenant id, adapter id and service tier.",
            labels,
            registry=self.registry,
        )
        # Reasoning share per tenant or adapter = reasoning_tokens / completion_tokens, summed by that label.
        self.reasoning_tokens = Counter(
            f"{_PREFIX}_reasoning_tokens",
            "Completion tokens spent inside a think block (billed at the reasoning price), by tenant, adapter and "
            "tier.",
            labels,
            registry=self.registry,
        )
        self.ratelimit_refusals = Counter(
            f"{_PREFIX}_ratelimit_refusals",
            "Requests refused by the rate limiter, by tenant id and reason (rate_limited, too_large, unavailable).",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            f"{_PREFIX}_requests_in_flight",
            "Completion requests holding a concurrency lease in this process (admitted and not yet ended), by tenant "
            "id; sum over replicas for a tenant's total.",
            ["tenant"],
            registry=self.registry,
        )
        self.concurrency_refusals = Counter(
            f"{_PREFIX}_concurrency_refusals",
            "Requests refused by the tenant's concurrency cap, by tenant id and reason (over_cap: 429; unavailable: "
            "503, Redis down and the failure policy closed).",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.concurrency_unavailable = Counter(
            f"{_PREFIX}_concurrency_unavailable",
            "Concurrency decisions made without the shared store (by the failure policy: admitted if open).",
            registry=self.registry,
        )
        self.overloaded = Counter(
            f"{_PREFIX}_overloaded",
            "Requests answered 503 overloaded because every engine replica tried was full, by tenant id.",
            ["tenant"],
            registry=self.registry,
        )
        self.engine_overloaded = Counter(
            f"{_PREFIX}_engine_overloaded",
            "503 overloaded answers from engine replicas (a request then tries another), by replica id.",
            ["replica"],
            registry=self.registry,
        )
        self.registry.register(_ReadAtScrape(rate_limiter, usage))

    def count_usage(self, event: UsageEvent) -> None:
        """Count one request's usage row (call once per request, where the row is recorded)."""
        tenant = str(event.tenant_id)
        adapter = "" if event.adapter_id is None else str(event.adapter_id)
        tier = str(event.service_tier)
        self.requests.labels(tenant, adapter, tier, event.status).inc()
        self.prompt_tokens.labels(tenant, adapter, tier).inc(event.prompt_tokens)
        self.cached_prompt_tokens.labels(tenant, adapter, tier).inc(event.cached_tokens)
        self.completion_tokens.labels(tenant, adapter, tier).inc(event.completion_tokens)
        self.reasoning_tokens.labels(tenant, adapter, tier).inc(event.reasoning_tokens)

    def count_refusal(self, tenant_id: str, decision: RateDecision) -> None:
        if not decision.allowed and decision.refusal is not None:
            self.ratelimit_refusals.labels(tenant_id, decision.refusal.value).inc()

    def count_lease(self, tenant_id: str, decision: LeaseDecision) -> None:
        """Count a lease decision: a lease taken is in flight until its release (`CountingLeases.release`)."""
        if decision.lease is not None:
            self.requests_in_flight.labels(tenant_id).inc()
            if not decision.lease.tracked:
                self.concurrency_unavailable.inc()
        elif decision.refusal is not None:
            self.concurrency_refusals.labels(tenant_id, decision.refusal.value).inc()
            if decision.refusal is LeaseRefusal.UNAVAILABLE:
                self.concurrency_unavailable.inc()

    def count_overloaded(self, tenant_id: str) -> None:
        """Count a request refused because every replica tried was full (once per request, where relay gives up)."""
        self.overloaded.labels(tenant_id).inc()

    def count_engine_overloaded(self, replica_id: str) -> None:
        self.engine_overloaded.labels(replica_id).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series; serve it with CONTENT_TYPE."""
        return generate_latest(self.registry)


class CountingRateLimiter:
    """A `RateLimiter` that counts the refusals of the one it wraps, by tenant and reason, in `metrics`."""

    def __init__(self, inner: RateLimiter, metrics: PlatformMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    @property
    def num_unavailable(self) -> int:
        return self._inner.num_unavailable

    @num_unavailable.setter
    def num_unavailable(self, value: int) -> None:
        self._inner.num_unavailable = value

    async def acquire(self, *, tenant_id: str, key_id: str, tenant: Limits, key: Limits, tokens: int) -> RateDecision:
        decision = await self._inner.acquire(tenant_id=tenant_id, key_id=key_id, tenant=tenant, key=key, tokens=tokens)
        self._metrics.count_refusal(tenant_id, decision)
        return decision


class CountingLeases:
    """`Leases` that count, in `metrics`, the leases held in this process (by tenant) and the refusals of the ones
    they wrap."""

    def __init__(self, inner: Leases, metrics: PlatformMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    @property
    def ttl_s(self) -> float:
        return self._inner.ttl_s

    async def acquire(self, tenant_id: str, *, cap: int) -> LeaseDecision:
        decision = await self._inner.acquire(tenant_id, cap=cap)
        self._metrics.count_lease(tenant_id, decision)
        return decision

    async def renew(self, lease: Lease) -> None:
        await self._inner.renew(lease)

    async def release(self, lease: Lease) -> None:
        self._metrics.requests_in_flight.labels(lease.tenant_id).dec()
        await self._inner.release(lease)


class MetricsController(Controller):
    path = "/"
    tags = ["operations"]

    @get("/metrics", summary="Prometheus metrics: requests, tokens and cache hits per tenant and adapter")
    async def metrics(self, state: State) -> Response[bytes]:
        # Through the app state, not the `AppResources` dependency: `Resources` holds a `PlatformMetrics`, so this
        # module cannot import the dependencies module (which imports `Resources`) without a cycle.
        metrics: PlatformMetrics = state.resources.metrics
        return Response(metrics.render(), media_type=CONTENT_TYPE)
