"""The platform's Prometheus /metrics: requests and tokens per tenant and adapter, counted where usage is recorded
(so they agree with what is billed), prefix-cache hits per tenant, rate-limit refusals; one registry per app.

The end-to-end tests run the platform of test_completions (embedded engine on the tiny checkpoint, real Postgres,
Redis and S3), its fixtures imported; the unit tests build `PlatformMetrics` alone.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.platform.domain.usage.recorder import MemoryOutbox, UsageEvent, UsageRecorder
from loraplex.platform.ids import TenantId
from loraplex.platform.metrics import CONTENT_TYPE, CountingRateLimiter, PlatformMetrics
from loraplex.platform.ratelimit import Limits, MemoryRateLimiter

from . import test_completions
from .test_completions import Platform, Tenant

# test_completions' fixtures, reused by name; module-scoped, so this module starts a platform of its own.
settings = test_completions.settings
platform = test_completions.platform
adapter_dir = test_completions.adapter_dir

PREFIX = "loraplex_platform"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a text exposition, by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels}`; 0 when the series does not exist (a counter not yet incremented)."""
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (PromQL's `sum(name{labels})`)."""
    wanted = set(labels.items())
    return sum(v for (found, have), v in samples(text).items() if found == name and wanted <= have)


def scrape(platform: Platform) -> str:
    """GET /metrics with the admin credential, as a Prometheus job configured with it does."""
    response = httpx.get(f"{platform.url}/metrics", headers=test_completions.ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def complete(platform: Platform, tenant: Tenant, model: str, prompt: str) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of one completion, as the response reports them."""
    usage = platform.client(tenant.key).completions.create(model=model, prompt=prompt, max_tokens=2).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return usage.prompt_tokens, cached, usage.completion_tokens


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_tokens_and_cache_hits_per_tenant_and_adapter_agree_with_usage(platform: Platform, adapter_dir: Path) -> None:
    mine, theirs = platform.make_tenant(), platform.make_tenant()
    adapter = platform.upload_adapter(mine, adapter_dir, "metrics")
    platform.make_endpoint(mine, "metrics-bot", platform.base_model, adapter["id"])
    # A prompt of its own, several blocks long: the second run finds its full blocks in the prefix cache.
    prompt = f"{secrets.token_hex(8)} " + " ".join(f"step {i} of the runbook;" for i in range(40))

    base_runs = [complete(platform, mine, platform.base_model, prompt) for _ in range(2)]
    adapter_run = complete(platform, mine, "metrics-bot", prompt)
    their_run = complete(platform, theirs, platform.base_model, prompt)
    assert base_runs[0][1] == 0 < base_runs[1][1]

    text = scrape(platform)
    base = {"tenant": mine.id, "adapter": "", "service_tier": "default"}
    on_adapter = {"tenant": mine.id, "adapter": adapter["id"], "service_tier": "default"}
    assert value(text, f"{PREFIX}_prompt_tokens_total", **base) == sum(run[0] for run in base_runs)
    assert value(text, f"{PREFIX}_cached_prompt_tokens_total", **base) == base_runs[1][1] > 0
    assert value(text, f"{PREFIX}_completion_tokens_total", **base) == sum(run[2] for run in base_runs)
    assert value(text, f"{PREFIX}_prompt_tokens_total", **on_adapter) == adapter_run[0]
    assert value(text, f"{PREFIX}_cached_prompt_tokens_total", **on_adapter) == adapter_run[1]
    requests = f"{PREFIX}_requests_total"
    assert total(text, requests, tenant=mine.id) == 3
    assert total(text, requests, **base) == 2
    assert total(text, requests, **on_adapter) == 1

    # The other tenant's series are its own: same prompt, none of this tenant's cache.
    other = {"tenant": theirs.id, "adapter": "", "service_tier": "default"}
    assert value(text, f"{PREFIX}_prompt_tokens_total", **other) == their_run[0]
    assert value(text, f"{PREFIX}_cached_prompt_tokens_total", **other) == their_run[1] == 0

    # The counters count what is billed: the same sums as the tenant's usage.
    totals = platform.get(mine, "/v1/usage").json()["totals"]
    prompt_total = total(text, f"{PREFIX}_prompt_tokens_total", tenant=mine.id)
    assert prompt_total == totals["prompt_tokens"]
    # Aggregates only: ids, never a tenant's or an adapter's name.
    assert "metrics-bot" not in text and '"metrics"' not in text


@pytest.mark.integration
def test_metrics_need_the_admin_credential(platform: Platform) -> None:
    """Per-tenant series are not for whoever reaches the port: no credential, a tenant's key or a wrong token is
    a 401, and the body names no tenant."""
    tenant = platform.make_tenant()
    complete(platform, tenant, platform.base_model, "count me")
    for headers in ({}, tenant.headers, {"Authorization": "Bearer not-the-admin-token"}):
        response = httpx.get(f"{platform.url}/metrics", headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert tenant.id not in response.text
    assert tenant.id in scrape(platform)


@pytest.mark.integration
def test_rate_limit_refusals_are_counted_per_tenant_and_not_as_requests(platform: Platform) -> None:
    tenant = platform.make_tenant()
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": 1}})
    assert response.status_code == 200, response.text
    complete(platform, tenant, platform.base_model, "hello")
    refused = platform.post(tenant, "/v1/completions", json={"model": platform.base_model, "prompt": "hello"})
    assert refused.status_code == 429, refused.text

    text = scrape(platform)
    assert value(text, f"{PREFIX}_ratelimit_refusals_total", tenant=tenant.id, reason="rate_limited") == 1
    assert total(text, f"{PREFIX}_requests_total", tenant=tenant.id) == 1
    for name in ("ratelimit_unavailable_total", "usage_deferred_total", "usage_lost_total"):
        assert value(text, f"{PREFIX}_{name}") == 0, name


# --- unit ---------------------------------------------------------------------------------------------------------


def metrics_alone() -> tuple[PlatformMetrics, MemoryRateLimiter]:
    limiter = MemoryRateLimiter()
    recorder = UsageRecorder(async_sessionmaker(), [MemoryOutbox()])  # never writes here
    return PlatformMetrics(limiter, recorder), limiter


def event(tenant_id: uuid.UUID, adapter_id: uuid.UUID | None, status: str = "ok") -> UsageEvent:
    now = datetime.now(UTC)
    return UsageEvent(
        request_id=f"cmpl-{uuid.uuid4().hex[:24]}",
        tenant_id=TenantId(tenant_id),
        api_key_id=None,
        endpoint_id=None,
        adapter_id=adapter_id,
        adapter_digest=None,
        model="m",
        base_model="m",
        prompt_tokens=100,
        cached_tokens=64,
        completion_tokens=7,
        reasoning_tokens=3,
        status=status,
        started_at=now,
        finished_at=now,
    )


@pytest.mark.unit
def test_each_instance_has_its_own_registry() -> None:
    (first, _), (second, _) = metrics_alone(), metrics_alone()
    tenant, adapter = uuid.uuid4(), uuid.uuid4()
    first.count_usage(event(tenant, adapter))
    first.count_usage(event(tenant, adapter, status="cancelled"))
    text = first.render().decode()
    labels = {"tenant": str(tenant), "adapter": str(adapter), "service_tier": "default"}
    assert value(text, f"{PREFIX}_requests_total", **labels, status="ok") == 1
    assert value(text, f"{PREFIX}_requests_total", **labels, status="cancelled") == 1
    assert value(text, f"{PREFIX}_prompt_tokens_total", **labels) == 200
    assert value(text, f"{PREFIX}_cached_prompt_tokens_total", **labels) == 128
    assert value(text, f"{PREFIX}_completion_tokens_total", **labels) == 14
    assert value(text, f"{PREFIX}_reasoning_tokens_total", **labels) == 6  # counted apart, and within completion
    assert str(tenant) not in second.render().decode()
    assert CONTENT_TYPE.startswith("text/plain")


@pytest.mark.unit
def test_the_counting_limiter_counts_refusals_by_reason_and_passes_decisions_through() -> None:
    metrics, limiter = metrics_alone()
    counting = CountingRateLimiter(limiter, metrics)
    tight = Limits(requests_per_minute=1, tokens_per_minute=100)

    async def acquire(tokens: int) -> bool:
        decision = await counting.acquire(tenant_id="t", key_id="k", tenant=tight, key=tight, tokens=tokens)
        return decision.allowed

    assert asyncio.run(acquire(10)) is True
    assert asyncio.run(acquire(10)) is False  # over the requests budget: rate_limited
    assert asyncio.run(acquire(1000)) is False  # more than a minute's tokens: too_large
    text = metrics.render().decode()
    assert value(text, f"{PREFIX}_ratelimit_refusals_total", tenant="t", reason="rate_limited") == 1
    assert value(text, f"{PREFIX}_ratelimit_refusals_total", tenant="t", reason="too_large") == 1
    limiter.num_unavailable = 3
    assert counting.num_unavailable == 3
    assert value(metrics.render().decode(), f"{PREFIX}_ratelimit_unavailable_total") == 3
