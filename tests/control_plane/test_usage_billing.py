"""GET /v1/usage's `billing`: a tenant's own bill, the admin billing report's numbers for that tenant, string for
string (same rating, same rounding), and never another tenant's usage. Usage rows are written straight into the
usage table, on real Postgres (completions write them in production)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.usage.repository import UsageRepository
from loraplex.platform.settings import Settings

from .conftest import bearer

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]
NOW = datetime.now(UTC).replace(microsecond=0)
START, END = NOW - timedelta(hours=2), NOW + timedelta(seconds=1)
BASE = "llama-a"
MONEY = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning", "cost_total", "cache_savings")
HEAD = {"currency", "group_by", "rows"}  # billing's fields that are not a report line's numbers


@pytest.fixture
async def sessions(app: Litestar, integration_settings: Settings) -> AsyncIterator[Sessions]:
    """Sessions on this test's database (migrated by the `app` fixture), with the base model BASE registered."""
    engine = create_engine(integration_settings.effective_database_url)
    try:
        factory = create_session_factory(engine)
        async with factory() as session:
            session.add(BaseModel(name=BASE, source=f"/models/{BASE}"))
            await session.commit()
        yield factory
    finally:
        await engine.dispose()


async def set_price(client: Client, admin_headers: dict[str, str], **prices: str) -> None:
    body = {"base_model": BASE, "effective_at": iso(NOW - timedelta(hours=3)), **prices}
    response = await client.put("/admin/prices", json=body, headers=admin_headers)
    assert response.status_code == 201, response.text


def usage(tenant_id: str, *, endpoint: uuid.UUID | None = None, model: str = BASE, **tokens: int) -> dict[str, Any]:
    started = NOW - timedelta(minutes=30)
    return {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "tenant_id": uuid.UUID(tenant_id),
        "api_key_id": None,
        "endpoint_id": endpoint,
        "adapter_id": None,
        "adapter_digest": None,
        "model": model,
        "base_model": BASE,
        "prompt_tokens": tokens.get("prompt", 0),
        "cached_tokens": tokens.get("cached", 0),
        "completion_tokens": tokens.get("completion", 0),
        "status": "ok",
        "started_at": started,
        "finished_at": started + timedelta(seconds=2),
    }


async def add_usage(sessions: Sessions, rows: list[dict[str, Any]]) -> None:
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == len(rows)
        await session.commit()


def iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


async def my_usage(client: Client, key: str, **params: str) -> Any:
    response = await client.get(
        "/v1/usage", params={"start": iso(START), "end": iso(END), **params}, headers=bearer(key)
    )
    assert response.status_code == 200, response.text
    return response.json()


async def admin_report(client: Client, admin_headers: dict[str, str], **params: str) -> Any:
    response = await client.get(
        "/admin/billing/report", params={"start": iso(START), "end": iso(END), **params}, headers=admin_headers
    )
    assert response.status_code == 200, response.text
    return response.json()


def numbers(line: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A billing object or report line without its head or key fields: the numbers alone."""
    return {name: value for name, value in line.items() if name not in HEAD and name not in keys}


@pytest.fixture
async def two_tenants(
    client: Client, admin_headers: dict[str, str], sessions: Sessions, make_tenant: Callable[[str], Any]
) -> tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str], uuid.UUID, uuid.UUID]:
    """(mine, my key), (theirs, their key), my endpoint's id, theirs; BASE costs 1 / 0.5 / 4 (input / cached /
    output per 1M tokens), so every cost below is whole micro-dollars and needs no rounding."""
    await set_price(client, admin_headers, input_per_mtok="1", cached_input_per_mtok="0.5", output_per_mtok="4")
    (mine, my_key), (theirs, their_key) = await make_tenant("mine"), await make_tenant("theirs")
    my_endpoint, their_endpoint = uuid.uuid4(), uuid.uuid4()
    await add_usage(
        sessions,
        [
            usage(
                mine["id"],
                endpoint=my_endpoint,
                model="support-bot",
                prompt=3_000_000,
                cached=1_000_000,
                completion=500_000,
            ),
            usage(mine["id"], endpoint=my_endpoint, model="support-bot", prompt=1_000_000, completion=250_000),
            usage(mine["id"], prompt=2_000_000, cached=2_000_000),  # named the base model: no endpoint
            usage(theirs["id"], endpoint=their_endpoint, model="their-bot", prompt=10_000_000, completion=1_000_000),
        ],
    )
    return (mine, my_key), (theirs, their_key), my_endpoint, their_endpoint


class TestUsageBilling:
    async def test_each_tenant_sees_the_admin_reports_line_for_itself_and_nothing_of_the_other(
        self, client: Client, admin_headers: dict[str, str], two_tenants: Any
    ) -> None:
        (mine, my_key), (theirs, their_key), _, _ = two_tenants
        by_tenant = await admin_report(client, admin_headers, group_by="tenant")
        admin_lines = {row["tenant_id"]: numbers(row, "tenant_name", "tenant_id") for row in by_tenant["rows"]}

        body = await my_usage(client, my_key)
        billing = body["billing"]
        assert billing["currency"] == "USD"
        assert billing["group_by"] is None and billing["rows"] is None
        assert numbers(billing) == admin_lines[mine["id"]]
        assert numbers(billing) == {
            "requests": 3,
            "unpriced_requests": 0,
            "input_uncached_tokens": 3_000_000,
            "input_cached_tokens": 3_000_000,
            "output_tokens": 750_000,
            "reasoning_tokens": 0,
            "cache_hit_rate": 0.5,
            "cost_uncached": "3.000000",  # (2M + 1M) x 1
            "cost_cached": "1.500000",  # 3M x 0.5
            "cost_output": "3.000000",  # 0.75M x 4
            "cost_reasoning": "0.000000",
            "cost_total": "7.500000",
            "cache_savings": "1.500000",  # 3M x (1 - 0.5)
        }
        # The usage fields are as before, and agree with the bill.
        assert body["totals"] == {
            "requests": 3,
            "prompt_tokens": 6_000_000,
            "cached_tokens": 3_000_000,
            "completion_tokens": 750_000,
            "reasoning_tokens": 0,
        }
        assert {"start", "end", "data", "has_more", "first_id", "last_id"} <= set(body)
        assert len(body["data"]) == 3

        theirs_billing = (await my_usage(client, their_key))["billing"]
        assert numbers(theirs_billing) == admin_lines[theirs["id"]]
        assert theirs_billing["requests"] == 1
        assert theirs_billing["cost_total"] == "14.000000"  # 10M x 1 + 1M x 4, none of mine

    async def test_rows_by_endpoint_model_and_day_are_the_admin_reports_for_the_tenant_only(
        self, client: Client, admin_headers: dict[str, str], two_tenants: Any
    ) -> None:
        (mine, my_key), (theirs, _), my_endpoint, their_endpoint = two_tenants
        for group_by in ("endpoint", "model", "day"):
            billing = (await my_usage(client, my_key, group_by=group_by))["billing"]
            admin = await admin_report(client, admin_headers, group_by=group_by, tenant_id=mine["id"])
            assert billing["group_by"] == group_by
            assert billing["rows"] == admin["rows"], group_by
            assert numbers(billing) == admin["totals"], group_by
            for name in MONEY:
                assert sum(Decimal(row[name]) for row in billing["rows"]) == Decimal(billing[name]), (group_by, name)
            assert sum(row["requests"] for row in billing["rows"]) == 3
        by_endpoint = (await my_usage(client, my_key, group_by="endpoint"))["billing"]["rows"]
        assert {(r["tenant_id"], r["endpoint_id"], r["model"], r["requests"]) for r in by_endpoint} == {
            (mine["id"], str(my_endpoint), "support-bot", 2),
            (mine["id"], None, BASE, 1),
        }
        assert theirs["id"] not in str(by_endpoint) and str(their_endpoint) not in str(by_endpoint)
        [by_model] = (await my_usage(client, my_key, group_by="model"))["billing"]["rows"]
        assert (by_model["base_model"], by_model["requests"], by_model["cost_total"]) == (BASE, 3, "7.500000")

    async def test_rounded_over_the_tenants_own_requests_as_the_filtered_admin_report(
        self,
        client: Client,
        admin_headers: dict[str, str],
        sessions: Sessions,
        make_tenant: Callable[[str], Any],
    ) -> None:
        # Three tenants, each with one uncached prompt token at 0.4 USD per 1M: 0.4 micro-dollars each, rounded once
        # per report (docs/decisions/0011-billing-rounding.md). Alone, each rounds to 0; the report of all three
        # rounds 1.2 to 1 micro-dollar and gives it to the first line. A tenant's bill is its own rounding: it does
        # not move with other tenants' usage.
        await set_price(client, admin_headers, input_per_mtok="0.4", output_per_mtok="0")
        tenants = [await make_tenant(f"small-{i}") for i in range(3)]
        await add_usage(sessions, [usage(tenant["id"], prompt=1) for tenant, _ in tenants])
        unfiltered = await admin_report(client, admin_headers, group_by="tenant")
        assert unfiltered["totals"]["cost_total"] == "0.000001"
        shared = {row["tenant_id"]: row for row in unfiltered["rows"]}
        for tenant, key in tenants:
            billing = (await my_usage(client, key))["billing"]
            filtered = await admin_report(client, admin_headers, group_by="tenant", tenant_id=tenant["id"])
            assert numbers(billing) == filtered["totals"]
            [line] = filtered["rows"]
            assert numbers(billing) == numbers(line, "tenant_name", "tenant_id")
            assert (billing["cost_uncached"], billing["cost_total"]) == ("0.000000", "0.000000")
            # In the report of every tenant, a part is still its exact value rounded down or up.
            for name in MONEY:
                assert abs(Decimal(billing[name]) - Decimal(shared[tenant["id"]][name])) <= Decimal("0.000001"), name
        assert sorted(row["cost_total"] for row in unfiltered["rows"]) == ["0.000000", "0.000000", "0.000001"]

    async def test_requests_without_a_price_are_counted_and_cost_nothing(
        self, client: Client, sessions: Sessions, make_tenant: Callable[[str], Any]
    ) -> None:
        tenant, key = await make_tenant("unpriced")
        await add_usage(sessions, [usage(tenant["id"], prompt=100, cached=40, completion=10)])
        billing = (await my_usage(client, key))["billing"]
        assert (billing["requests"], billing["unpriced_requests"], billing["input_uncached_tokens"]) == (1, 1, 60)
        assert all(billing[name] == "0.000000" for name in MONEY)

    async def test_an_empty_period_costs_zero(self, client: Client, make_tenant: Callable[[str], Any]) -> None:
        _, key = await make_tenant("idle")
        billing = (await my_usage(client, key, group_by="day"))["billing"]
        assert billing["rows"] == []
        assert billing["requests"] == 0
        assert billing["cost_total"] == "0.000000"

    @pytest.mark.parametrize("group_by", ["tenant", "week", ""])
    async def test_other_groupings_are_400(
        self, client: Client, make_tenant: Callable[[str], Any], group_by: str
    ) -> None:
        # By tenant would be one line, the totals; the cross-tenant groupings are the admin report's.
        _, key = await make_tenant("bad-group")
        response = await client.get("/v1/usage", params={"group_by": group_by}, headers=bearer(key))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "group_by"
