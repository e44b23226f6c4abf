"""Reasoning tokens in billing, on real Postgres: a price version's reasoning price (PUT /admin/prices; the output
price unless given, versioned like the other prices), rating that prices the reasoning tokens apart from the other
output tokens, and the figures in the admin report (JSON and CSV), the billing page, the tenant's /v1/usage and the
console's usage page. Usage rows are written straight into the usage table (completions write them in production:
test_completions_reasoning.py)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from _support.console import sign_in
from _support.usage_rows import usage_row
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.billing.models import PriceVersion
from loraplex.platform.domain.usage.repository import UsageRepository

from .conftest import bearer

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]
NOW = datetime.now(UTC).replace(microsecond=0)


def iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


@pytest.fixture
async def base_model(sessions: Sessions) -> str:
    async with sessions() as session:
        session.add(BaseModel(name="llama-a", source="/models/llama-a"))
        await session.commit()
    return "llama-a"


async def put_price(client: Client, headers: dict[str, str], **body: Any) -> Any:
    return await client.put("/admin/prices", json={"base_model": "llama-a", **body}, headers=headers)


async def stored_versions(sessions: Sessions) -> list[PriceVersion]:
    async with sessions() as session:
        return list((await session.scalars(select(PriceVersion).order_by(PriceVersion.effective_at))).all())


class TestReasoningPrice:
    async def test_defaults_to_the_output_price_and_is_versioned(
        self, client: Client, admin_headers: dict[str, str], base_model: str, sessions: Sessions
    ) -> None:
        first = await put_price(
            client, admin_headers, input_per_mtok="1", output_per_mtok="4", effective_at=iso(NOW - timedelta(days=2))
        )
        assert first.status_code == 201, first.text
        assert first.json()["reasoning_per_mtok"] == "4"  # none given: what output tokens cost
        second = await put_price(
            client,
            admin_headers,
            input_per_mtok="1",
            output_per_mtok="4",
            reasoning_per_mtok="12.5",
            effective_at=iso(NOW - timedelta(days=1)),
        )
        assert second.status_code == 201, second.text
        assert second.json()["reasoning_per_mtok"] == "12.5"
        listed = (await client.get("/admin/prices", headers=admin_headers)).json()["data"]
        assert [(p["reasoning_per_mtok"], p["status"]) for p in listed] == [("12.5", "current"), ("4", "superseded")]
        assert [str(v.reasoning_per_mtok.normalize()) for v in await stored_versions(sessions)] == ["4", "12.5"]

    async def test_a_bad_reasoning_price_is_refused_and_nothing_is_written(
        self, client: Client, admin_headers: dict[str, str], base_model: str, sessions: Sessions
    ) -> None:
        for bad in ("-1", "0.0000000001", "1e6", "NaN", True, "cheap"):
            response = await put_price(
                client, admin_headers, input_per_mtok="1", output_per_mtok="4", reasoning_per_mtok=bad
            )
            assert response.status_code == 400, (bad, response.text)
            assert "reasoning_per_mtok" in response.text, (bad, response.text)
        assert await stored_versions(sessions) == []


# Priced at 1 / 0.1 / 4 USD per 1M tokens from 3 hours ago (reasoning: the output price), then from an hour ago
# with reasoning at 10. One request under each version, 1M prompt tokens (none cached) and 1M completion tokens:
# the first with 400k of them reasoning, the second with 250k.
EXPECTED = {
    "requests": 2,
    "unpriced_requests": 0,
    "input_uncached_tokens": 2_000_000,
    "input_cached_tokens": 0,
    "output_tokens": 2_000_000,
    "reasoning_tokens": 650_000,
    "cache_hit_rate": 0.0,
    "cost_uncached": "2.000000",  # 2M x 1
    "cost_cached": "0.000000",
    "cost_output": "5.400000",  # 600k x 4 + 750k x 4
    "cost_reasoning": "4.100000",  # 400k x 4 (the output price, by default) + 250k x 10
    "cost_total": "11.500000",  # the first request costs what it did before reasoning had a price: 1 + 1M x 4
    "cache_savings": "0.000000",
}


@pytest.fixture
async def rated(
    client: Client, admin_headers: dict[str, str], base_model: str, sessions: Sessions, make_tenant: Any
) -> Any:
    """(tenant, key) of the tenant with EXPECTED's two requests."""
    for hours, reasoning in ((3, None), (1, "10")):
        extra = {} if reasoning is None else {"reasoning_per_mtok": reasoning}
        response = await put_price(
            client,
            admin_headers,
            input_per_mtok="1",
            output_per_mtok="4",
            effective_at=iso(NOW - timedelta(hours=hours)),
            **extra,
        )
        assert response.status_code == 201, response.text
    tenant, key = await make_tenant("thinker")
    rows = [
        usage_row(
            tenant["id"],
            NOW - timedelta(hours=hours),
            prompt_tokens=1_000_000,
            completion_tokens=1_000_000,
            reasoning_tokens=reasoning,
        )
        for hours, reasoning in ((2, 400_000), (0.5, 250_000))
    ]
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == 2
        await session.commit()
    return tenant, key


class TestReport:
    async def test_json_prices_reasoning_tokens_apart_by_the_version_in_force(
        self, client: Client, admin_headers: dict[str, str], rated: Any
    ) -> None:
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW), "group_by": "model"}
        body = (await client.get("/admin/billing/report", params=params, headers=admin_headers)).json()
        [row] = body["rows"]
        assert row == {"base_model": "llama-a", **EXPECTED}
        assert body["totals"] == EXPECTED

    async def test_csv_has_the_same_figures_in_columns_of_their_own(
        self, client: Client, admin_headers: dict[str, str], rated: Any
    ) -> None:
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW), "group_by": "model", "format": "csv"}
        response = await client.get("/admin/billing/report", params=params, headers=admin_headers)
        assert response.status_code == 200, response.text
        header, line, totals = list(csv.reader(io.StringIO(response.text)))
        assert header == ["base_model", *EXPECTED]
        shown = dict(zip(header, line, strict=True))
        assert shown["reasoning_tokens"] == "650000"
        assert (shown["cost_output"], shown["cost_reasoning"], shown["cost_total"]) == (
            "5.400000",
            "4.100000",
            "11.500000",
        )
        assert totals[1:] == line[1:]

    async def test_the_tenants_usage_shows_its_reasoning_tokens_and_their_cost(
        self, client: Client, rated: Any
    ) -> None:
        _, key = rated
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW)}
        body = (await client.get("/v1/usage", params=params, headers=bearer(key))).json()
        assert body["totals"]["completion_tokens"] == 2_000_000
        assert body["totals"]["reasoning_tokens"] == 650_000
        assert sorted(r["reasoning_tokens"] for r in body["data"]) == [250_000, 400_000]
        billing = body["billing"]
        assert {name: billing[name] for name in EXPECTED} == EXPECTED

    async def test_the_billing_page_shows_reasoning_tokens_beside_output_tokens(
        self, client: Client, admin_headers: dict[str, str], rated: Any
    ) -> None:
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW)}
        response = await client.get("/admin/billing", params=params, headers=admin_headers)
        assert response.status_code == 200, response.text
        page = response.text
        assert "<th>Output tokens</th>" in page and "<th>Reasoning tokens</th>" in page
        assert page.count('<td data-label="Reasoning tokens">650,000</td>') == 2  # the tenant's row and the totals
        assert "2,000,000 output (650,000 reasoning)" in page
        assert "$11.500000" in page

    async def test_the_console_usage_page_shows_reasoning_tokens(self, client: Client, rated: Any) -> None:
        _, key = rated
        assert (await sign_in(client, key)).status_code in (200, 303)
        response = await client.get("/console/usage")
        assert response.status_code == 200, response.text
        assert "Reasoning tokens" in response.text
        assert "2,000,000 output (650,000 reasoning)" in response.text
        # The bill per day and per endpoint: each a line and its totals (the two requests may fall on two days).
        assert response.text.count('data-label="Reasoning tokens">650,000</td>') >= 2
