"""Prices per service tier on real Postgres: the price book holds a version per (base model, tier); a request is
rated by its own tier's version in force when it started, else by the default tier's (docs/decisions/0026). Usage
rows are written straight into the usage table (completions write them in production)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
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
BASE = "llama-a"
MONEY = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning", "cost_total", "cache_savings")


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


def iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


async def put_price(client: Client, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await client.put("/admin/prices", json={"base_model": BASE, **body}, headers=headers)
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


def usage(tenant_id: str, started_at: datetime, tier: str) -> dict[str, Any]:
    """1M prompt tokens (200k of them cached) and 100k completion tokens, on `tier`."""
    return {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "tenant_id": uuid.UUID(tenant_id),
        "api_key_id": None,
        "endpoint_id": None,
        "adapter_id": None,
        "adapter_digest": None,
        "model": BASE,
        "base_model": BASE,
        "prompt_tokens": 1_000_000,
        "cached_tokens": 200_000,
        "completion_tokens": 100_000,
        "status": "ok",
        "service_tier": tier,
        "started_at": started_at,
        "finished_at": started_at + timedelta(seconds=2),
    }


async def add_usage(sessions: Sessions, rows: list[dict[str, Any]]) -> None:
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == len(rows)
        await session.commit()


class TestPriceBook:
    async def test_a_version_per_tier_each_with_its_own_history(
        self, client: Client, admin_headers: dict[str, str], sessions: Sessions
    ) -> None:
        default = await put_price(client, admin_headers, input_per_mtok="1", output_per_mtok="4")
        assert default["service_tier"] == "default"  # the tier when none is given
        at = iso(NOW - timedelta(hours=1))
        older_flex = await put_price(
            client, admin_headers, service_tier="flex", input_per_mtok="0.5", output_per_mtok="2", effective_at=at
        )
        assert older_flex["service_tier"] == "flex"
        # The same instant for another tier is another version; for the same tier it is a conflict.
        await put_price(
            client, admin_headers, service_tier="priority", input_per_mtok="3", output_per_mtok="9", effective_at=at
        )
        again = {"base_model": BASE, "service_tier": "flex", "input_per_mtok": "7", "output_per_mtok": "7"}
        response = await client.put("/admin/prices", json={**again, "effective_at": at}, headers=admin_headers)
        assert response.status_code == 409, response.text
        assert response.json()["code"] == "conflict"
        await put_price(client, admin_headers, service_tier="flex", input_per_mtok="0.4", output_per_mtok="1.6")
        listed = (await client.get("/admin/prices", headers=admin_headers)).json()["data"]
        # By tier, newest first; each tier has its own current version.
        assert [(p["service_tier"], p["input_per_mtok"], p["status"]) for p in listed] == [
            ("default", "1", "current"),
            ("flex", "0.4", "current"),
            ("flex", "0.5", "superseded"),
            ("priority", "3", "current"),
        ]

    async def test_a_tier_that_does_not_exist_is_400_and_writes_nothing(
        self, client: Client, admin_headers: dict[str, str], sessions: Sessions
    ) -> None:
        for tier in ("scale", "auto", "", None, 1):
            body = {"base_model": BASE, "service_tier": tier, "input_per_mtok": "1", "output_per_mtok": "1"}
            response = await client.put("/admin/prices", json=body, headers=admin_headers)
            assert response.status_code == 400, (tier, response.text)
            assert "service_tier" in response.text, response.text
        assert (await client.get("/admin/prices", headers=admin_headers)).json()["data"] == []

    async def test_history_is_protected_per_tier_and_a_default_version_for_every_tier(
        self, client: Client, admin_headers: dict[str, str], sessions: Sessions, make_tenant: Any
    ) -> None:
        tenant, _ = await make_tenant("acme")
        await add_usage(sessions, [usage(tenant["id"], NOW - timedelta(hours=1), "flex")])
        prices = {"input_per_mtok": "1", "output_per_mtok": "1", "effective_at": iso(NOW - timedelta(hours=2))}
        # A flex version would re-rate that flex request; a default one too (it rated the request, flex having no
        # price of its own). A priority one rates no recorded request.
        for tier in ("flex", "default"):
            body = {"base_model": BASE, "service_tier": tier, **prices}
            response = await client.put("/admin/prices", json=body, headers=admin_headers)
            assert response.status_code == 409, response.text
            assert response.json()["code"] == "would_rewrite_history"
        await put_price(client, admin_headers, service_tier="priority", **prices)
        listed = (await client.get("/admin/prices", headers=admin_headers)).json()["data"]
        assert [p["service_tier"] for p in listed] == ["priority"]


@pytest.fixture
async def tiered(client: Client, admin_headers: dict[str, str], sessions: Sessions) -> None:
    """default: 1 / 0.5 / 4 (input / cached / output per 1M) from NOW - 3h; flex: 0.5 / 0.25 / 2 from NOW - 1h;
    priority: 3 / 1.5 / 12 only from tomorrow (scheduled, in force for nothing yet)."""
    for tier, prices, since in (
        ("default", ("1", "0.5", "4"), NOW - timedelta(hours=3)),
        ("flex", ("0.5", "0.25", "2"), NOW - timedelta(hours=1)),
        ("priority", ("3", "1.5", "12"), NOW + timedelta(days=1)),
    ):
        await put_price(
            client,
            admin_headers,
            service_tier=tier,
            input_per_mtok=prices[0],
            cached_input_per_mtok=prices[1],
            output_per_mtok=prices[2],
            effective_at=iso(since),
        )


# What one usage row (800k uncached, 200k cached, 100k output) costs at each price, exactly.
AT_DEFAULT = {
    "cost_uncached": "0.800000",  # 800k x 1 / 1M
    "cost_cached": "0.100000",  # 200k x 0.5 / 1M
    "cost_output": "0.400000",  # 100k x 4 / 1M
    "cost_reasoning": "0.000000",
    "cost_total": "1.300000",
    "cache_savings": "0.100000",  # 200k x (1 - 0.5) / 1M
}
AT_FLEX = {
    "cost_uncached": "0.400000",
    "cost_cached": "0.050000",
    "cost_output": "0.200000",
    "cost_reasoning": "0.000000",
    "cost_total": "0.650000",
    "cache_savings": "0.050000",
}


def added(*costs: dict[str, str]) -> dict[str, str]:
    return {name: f"{sum(Decimal(c[name]) for c in costs):.6f}" for name in MONEY}


class TestRating:
    async def test_each_tier_at_its_own_price_else_the_default_tiers(
        self, client: Client, admin_headers: dict[str, str], sessions: Sessions, make_tenant: Any, tiered: None
    ) -> None:
        tenant, key = await make_tenant("acme")
        tenant_id = tenant["id"]
        await add_usage(
            sessions,
            [
                usage(tenant_id, NOW - timedelta(minutes=30), "default"),
                # flex before its first version (the default tier's price), then at it (its own).
                usage(tenant_id, NOW - timedelta(hours=1, microseconds=1), "flex"),
                usage(tenant_id, NOW - timedelta(hours=1), "flex"),
                # priority's only version is scheduled: the default tier's price.
                usage(tenant_id, NOW - timedelta(minutes=30), "priority"),
            ],
        )
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW), "group_by": "service_tier"}
        response = await client.get("/admin/billing/report", params=params, headers=admin_headers)
        assert response.status_code == 200, response.text
        report = response.json()
        rows = {r["service_tier"]: r for r in report["rows"]}
        assert list(rows) == ["default", "flex", "priority"]
        assert {name: rows["default"][name] for name in MONEY} == AT_DEFAULT
        assert {name: rows["flex"][name] for name in MONEY} == added(AT_DEFAULT, AT_FLEX)
        assert {name: rows["priority"][name] for name in MONEY} == AT_DEFAULT
        assert [rows[t]["requests"] for t in rows] == [1, 2, 1]
        assert all(r["unpriced_requests"] == 0 for r in rows.values())
        assert report["totals"]["cost_total"] == "4.550000"  # 3 x 1.3 + 0.65
        # Other groupings rate the same requests the same way.
        by_model = await client.get(
            "/admin/billing/report", params={**params, "group_by": "model"}, headers=admin_headers
        )
        assert {name: by_model.json()["totals"][name] for name in MONEY} == added(
            AT_DEFAULT, AT_DEFAULT, AT_FLEX, AT_DEFAULT
        )
        # And the tenant sees the same bill, by tier, with each request's tier.
        mine = await client.get("/v1/usage", params={**params, "group_by": "service_tier"}, headers=bearer(key))
        assert mine.status_code == 200, mine.text
        bill = mine.json()["billing"]
        assert bill["group_by"] == "service_tier"
        assert bill["rows"] == report["rows"]
        assert bill["cost_total"] == "4.550000"
        assert sorted(r["service_tier"] for r in mine.json()["data"]) == ["default", "flex", "flex", "priority"]

    async def test_a_tier_without_any_price_is_unpriced_only_when_default_has_none_either(
        self, client: Client, admin_headers: dict[str, str], sessions: Sessions, make_tenant: Any
    ) -> None:
        tenant, _ = await make_tenant("acme")
        await put_price(
            client,
            admin_headers,
            service_tier="flex",
            input_per_mtok="0.5",
            cached_input_per_mtok="0.25",
            output_per_mtok="2",
            effective_at=iso(NOW - timedelta(hours=2)),
        )
        await add_usage(
            sessions,
            [usage(tenant["id"], NOW - timedelta(hours=1), tier) for tier in ("flex", "default", "priority")],
        )
        params = {"start": iso(NOW - timedelta(hours=4)), "end": iso(NOW), "group_by": "service_tier"}
        report = (await client.get("/admin/billing/report", params=params, headers=admin_headers)).json()
        rows = {r["service_tier"]: r for r in report["rows"]}
        # No default price: default and priority requests are counted and rated 0; flex has its own.
        assert {t: (r["requests"], r["unpriced_requests"], r["cost_total"]) for t, r in rows.items()} == {
            "default": (1, 1, "0.000000"),
            "flex": (1, 0, "0.650000"),
            "priority": (1, 1, "0.000000"),
        }
        assert report["totals"]["unpriced_requests"] == 2
