"""Billing on real Postgres: the admin price book (/admin/prices) and the report (/admin/billing/report), with usage
rows written straight into the usage table (completions write them in production)."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

import pytest
from _support.usage_rows import usage_row
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.billing.models import PriceVersion
from loraplex.platform.domain.billing.rating import GroupBy
from loraplex.platform.domain.billing.service import BillingService
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.repository import UsageRepository

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]
NOW = datetime.now(UTC).replace(microsecond=0)
MONEY = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning", "cost_total", "cache_savings")


@pytest.fixture
async def base_models(sessions: Sessions) -> list[str]:
    names = ["llama-a", "llama-b"]
    async with sessions() as session:
        session.add_all(BaseModel(name=name, source=f"/models/{name}") for name in names)
        await session.commit()
    return names


@pytest.fixture
async def tenants(sessions: Sessions) -> list[Tenant]:
    async with sessions() as session:
        made = [Tenant(name="acme"), Tenant(name='zeta, "the" co')]
        session.add_all(made)
        await session.commit()
        return made


ROW = {"prompt_tokens": 1000}  # this module's usual request


def usage(tenant: Tenant, started_at: datetime, **changes: Any) -> dict[str, Any]:
    return usage_row(tenant.id, started_at, **(ROW | changes))


async def add_usage(sessions: Sessions, rows: list[dict[str, Any]]) -> None:
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent(rows) == len(rows)
        await session.commit()


async def put_price(client: Client, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await client.put("/admin/prices", json=body, headers=headers)
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


def iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


async def report(client: Client, headers: dict[str, str], start: datetime, end: datetime, **params: str) -> Any:
    response = await client.get(
        "/admin/billing/report", params={"start": iso(start), "end": iso(end), **params}, headers=headers
    )
    assert response.status_code == 200, response.text
    return response.json()


class TestPrices:
    async def test_put_adds_a_version_with_cached_input_a_tenth_by_default(
        self, client: Client, admin_headers: dict[str, str], base_models: list[str]
    ) -> None:
        added = await put_price(client, admin_headers, base_model="llama-a", input_per_mtok="0.15", output_per_mtok=0.6)
        assert added["input_per_mtok"] == "0.15"
        assert added["cached_input_per_mtok"] == "0.015"
        assert added["output_per_mtok"] == "0.6"
        assert added["currency"] == "USD"
        assert added["status"] == "current"
        assert abs(datetime.fromisoformat(added["effective_at"]) - datetime.now(UTC)) < timedelta(minutes=1)

    async def test_history_per_base_model_marks_the_version_in_force(
        self, client: Client, admin_headers: dict[str, str], base_models: list[str]
    ) -> None:
        for days, price in ((-2, "1"), (-1, "2"), (1, "3")):
            await put_price(
                client,
                admin_headers,
                base_model="llama-a",
                input_per_mtok=price,
                output_per_mtok=price,
                effective_at=iso(NOW + timedelta(days=days)),
            )
        await put_price(client, admin_headers, base_model="llama-b", input_per_mtok="5", output_per_mtok="5")
        listed = (await client.get("/admin/prices", headers=admin_headers)).json()
        assert listed["object"] == "list"
        assert [(p["base_model"], p["input_per_mtok"], p["status"]) for p in listed["data"]] == [
            ("llama-a", "3", "scheduled"),
            ("llama-a", "2", "current"),
            ("llama-a", "1", "superseded"),
            ("llama-b", "5", "current"),
        ]
        only_b = (await client.get("/admin/prices", params={"base_model": "llama-b"}, headers=admin_headers)).json()
        assert [p["base_model"] for p in only_b["data"]] == ["llama-b"]

    async def test_bad_versions_are_refused_and_nothing_is_written(
        self, client: Client, admin_headers: dict[str, str], base_models: list[str]
    ) -> None:
        good = {"base_model": "llama-a", "input_per_mtok": "1", "output_per_mtok": "1"}
        cases: list[tuple[dict[str, Any], str]] = [
            ({**good, "base_model": "nope"}, "base_model"),
            ({**good, "cached_input_per_mtok": "2"}, "cached_input_per_mtok"),
            ({**good, "input_per_mtok": "0.0000000001"}, "input_per_mtok"),  # 10 decimals: refused, not rounded
            ({**good, "input_per_mtok": "-1"}, "input_per_mtok"),
            ({**good, "output_per_mtok": "1e6"}, "output_per_mtok"),
            ({**good, "input_per_mtok": "NaN"}, "input_per_mtok"),
            ({**good, "currency": "EUR"}, "currency"),
            ({"base_model": "llama-a", "input_per_mtok": "1"}, "output_per_mtok"),
        ]
        for body, param in cases:
            response = await client.put("/admin/prices", json=body, headers=admin_headers)
            assert response.status_code == 400, (body, response.text)
            assert param in response.text, (body, response.text)
        assert (await client.get("/admin/prices", headers=admin_headers)).json()["data"] == []

    async def test_one_version_per_instant(
        self, client: Client, admin_headers: dict[str, str], base_models: list[str]
    ) -> None:
        body = {"base_model": "llama-a", "input_per_mtok": "1", "output_per_mtok": "1", "effective_at": iso(NOW)}
        await put_price(client, admin_headers, **body)
        response = await client.put("/admin/prices", json={**body, "input_per_mtok": "2"}, headers=admin_headers)
        assert response.status_code == 409
        assert len((await client.get("/admin/prices", headers=admin_headers)).json()["data"]) == 1

    async def test_a_version_never_re_rates_recorded_requests(
        self,
        client: Client,
        admin_headers: dict[str, str],
        base_models: list[str],
        tenants: list[Tenant],
        sessions: Sessions,
    ) -> None:
        await add_usage(sessions, [usage(tenants[0], NOW - timedelta(hours=1))])
        body = {"base_model": "llama-a", "input_per_mtok": "1", "output_per_mtok": "1"}
        response = await client.put(
            "/admin/prices", json={**body, "effective_at": iso(NOW - timedelta(hours=2))}, headers=admin_headers
        )
        assert response.status_code == 409
        assert response.json()["code"] == "would_rewrite_history"
        # Back to a time after the last recorded request of that model is fine; so is any time for another model.
        await put_price(client, admin_headers, **body, effective_at=iso(NOW - timedelta(minutes=30)))
        await put_price(
            client, admin_headers, **{**body, "base_model": "llama-b"}, effective_at=iso(NOW - timedelta(days=9))
        )

    async def test_only_admins(self, client: Client, make_tenant: Any, base_models: list[str]) -> None:
        _, key = await make_tenant("acme")
        for headers in ({}, {"Authorization": f"Bearer {key}"}):
            assert (await client.get("/admin/prices", headers=headers)).status_code == 401
            response = await client.put(
                "/admin/prices",
                json={"base_model": "llama-a", "input_per_mtok": "1", "output_per_mtok": "1"},
                headers=headers,
            )
            assert response.status_code == 401
            assert (await client.get("/admin/billing/report", headers=headers)).status_code == 401


@pytest.fixture
async def priced(client: Client, admin_headers: dict[str, str], base_models: list[str]) -> datetime:
    """llama-a costs 1 / 0.5 / 4 (input / cached / output per 1M tokens) from NOW - 3h, then 2 / 1 / 8 from the
    returned instant (NOW - 1h); llama-b has no price."""
    change = NOW - timedelta(hours=1)
    for since, scale in ((NOW - timedelta(hours=3), 1), (change, 2)):
        await put_price(
            client,
            admin_headers,
            base_model="llama-a",
            input_per_mtok=str(1 * scale),
            cached_input_per_mtok=str(Decimal("0.5") * scale),
            output_per_mtok=str(4 * scale),
            effective_at=iso(since),
        )
    return change


class TestReport:
    async def test_each_request_is_rated_by_the_version_in_force_when_it_started(
        self, client: Client, admin_headers: dict[str, str], tenants: list[Tenant], sessions: Sessions, priced: datetime
    ) -> None:
        acme = tenants[0]
        tokens = {"prompt_tokens": 3_000_000, "cached_tokens": 1_000_000, "completion_tokens": 500_000}
        await add_usage(
            sessions,
            [
                # Started a microsecond before the change and finished after it: the old price.
                usage(acme, priced - timedelta(microseconds=1), **tokens),
                # Started exactly at the change: the new price.
                usage(acme, priced, **tokens),
            ],
        )
        body = await report(client, admin_headers, NOW - timedelta(hours=4), NOW, group_by="model")
        assert body["group_by"] == "model"
        assert body["currency"] == "USD"
        assert set(body) == {"object", "start", "end", "group_by", "currency", "rows", "totals"}
        [row] = body["rows"]
        assert row == {
            "base_model": "llama-a",
            "requests": 2,
            "unpriced_requests": 0,
            "input_uncached_tokens": 4_000_000,
            "input_cached_tokens": 2_000_000,
            "output_tokens": 1_000_000,
            "reasoning_tokens": 0,
            "cache_hit_rate": 0.3333,
            "cost_uncached": "6.000000",  # 2M x 1 + 2M x 2
            "cost_cached": "1.500000",  # 1M x 0.5 + 1M x 1
            "cost_output": "6.000000",  # 0.5M x 4 + 0.5M x 8
            "cost_reasoning": "0.000000",
            "cost_total": "13.500000",
            "cache_savings": "1.500000",  # 1M x (1 - 0.5) + 1M x (2 - 1)
        }
        assert body["totals"] == {k: v for k, v in row.items() if k != "base_model"}

    async def test_groups_by_tenant_endpoint_and_day(
        self, client: Client, admin_headers: dict[str, str], tenants: list[Tenant], sessions: Sessions, priced: datetime
    ) -> None:
        acme, zeta = tenants
        endpoint = uuid.uuid4()
        day_start = NOW.replace(hour=0, minute=0, second=0)
        # Within NOW's day even when the suite runs in the first hour after midnight (UTC), when the price change
        # (NOW - 1h) falls on the day before.
        today = max(priced, day_start)
        await add_usage(
            sessions,
            [
                usage(acme, today, endpoint_id=endpoint, model="support-bot"),
                usage(acme, today, endpoint_id=endpoint, model="support-bot"),
                usage(acme, today),
                usage(zeta, today, completion_tokens=1000),
                usage(zeta, day_start - timedelta(microseconds=1)),  # the day before, in UTC
            ],
        )
        start, end = day_start - timedelta(days=1), NOW + timedelta(seconds=1)
        by_tenant = await report(client, admin_headers, start, end, group_by="tenant")
        assert [(r["tenant_name"], r["tenant_id"], r["requests"]) for r in by_tenant["rows"]] == [
            ("acme", str(acme.id), 3),
            ('zeta, "the" co', str(zeta.id), 2),
        ]
        by_endpoint = await report(client, admin_headers, start, end, group_by="endpoint")
        assert {(r["tenant_id"], r["endpoint_id"], r["model"], r["requests"]) for r in by_endpoint["rows"]} == {
            (str(acme.id), str(endpoint), "support-bot", 2),
            (str(acme.id), None, "llama-a", 1),
            (str(zeta.id), None, "llama-a", 2),
        }
        by_day = await report(client, admin_headers, start, end, group_by="day")
        previous = (day_start - timedelta(days=1)).date().isoformat()
        assert [(r["day"], r["requests"]) for r in by_day["rows"]] == [(previous, 1), (day_start.date().isoformat(), 4)]
        for body in (by_tenant, by_endpoint, by_day):
            assert body["totals"]["requests"] == 5
            for name in MONEY:
                assert sum(Decimal(r[name]) for r in body["rows"]) == Decimal(body["totals"][name])
        only_zeta = await report(client, admin_headers, start, end, group_by="model", tenant_id=str(zeta.id))
        assert only_zeta["totals"]["requests"] == 2

    async def test_requests_without_a_price_are_counted_and_rated_zero(
        self, client: Client, admin_headers: dict[str, str], tenants: list[Tenant], sessions: Sessions, priced: datetime
    ) -> None:
        await add_usage(
            sessions,
            [
                usage(tenants[0], priced, base_model="llama-b", model="llama-b"),
                usage(tenants[0], NOW - timedelta(hours=5)),  # before llama-a's first version
                usage(tenants[0], priced),
            ],
        )
        body = await report(client, admin_headers, NOW - timedelta(hours=6), NOW, group_by="model")
        rows = {r["base_model"]: r for r in body["rows"]}
        assert (rows["llama-a"]["requests"], rows["llama-a"]["unpriced_requests"]) == (2, 1)
        assert rows["llama-a"]["cost_total"] == "0.002000"  # only the priced one: 1000 x 2 per 1M
        assert (rows["llama-b"]["requests"], rows["llama-b"]["unpriced_requests"]) == (1, 1)
        assert rows["llama-b"]["cost_total"] == "0.000000"
        assert rows["llama-b"]["input_uncached_tokens"] == 1000
        assert body["totals"]["unpriced_requests"] == 2

    async def test_the_period_includes_start_and_excludes_end(
        self, client: Client, admin_headers: dict[str, str], tenants: list[Tenant], sessions: Sessions, priced: datetime
    ) -> None:
        start, end = priced, priced + timedelta(minutes=10)
        await add_usage(
            sessions,
            [usage(tenants[0], start), usage(tenants[0], end - timedelta(microseconds=1)), usage(tenants[0], end)],
        )
        body = await report(client, admin_headers, start, end)
        assert body["totals"]["requests"] == 2
        assert body["start"].startswith(start.isoformat()[:19])

    async def test_csv_has_a_header_a_row_per_group_and_totals(
        self, client: Client, admin_headers: dict[str, str], tenants: list[Tenant], sessions: Sessions, priced: datetime
    ) -> None:
        await add_usage(sessions, [usage(tenants[0], priced), usage(tenants[1], priced, cached_tokens=400)])
        response = await client.get(
            "/admin/billing/report",
            params={"start": iso(priced), "end": iso(NOW), "group_by": "tenant", "format": "csv"},
            headers=admin_headers,
        )
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/csv")
        assert "attachment" in response.headers["content-disposition"]
        assert '"zeta, ""the"" co"' in response.text
        rows = list(csv.DictReader(io.StringIO(response.text)))
        assert [r["tenant_name"] for r in rows] == ["acme", 'zeta, "the" co', "total"]
        assert rows[-1]["tenant_id"] == ""
        assert rows[-1]["requests"] == "2"
        assert rows[-1]["cost_total"] == "0.003600"  # 1000 x 2 + 600 x 2 + 400 x 1, per 1M
        assert rows[1]["cache_savings"] == "0.000400"
        for name in MONEY:
            assert sum(Decimal(r[name]) for r in rows[:-1]) == Decimal(rows[-1][name])

    async def test_bad_parameters_are_400(self, client: Client, admin_headers: dict[str, str]) -> None:
        cases = [
            {"group_by": "week"},
            {"format": "xml"},
            {"start": "2026-11-02", "end": "2026-11-01"},
            {"start": "2026-01-01", "end": "2026-11-01"},  # longer than 92 days
            {"start": "yesterday"},
            {"tenant_id": "not-a-uuid"},
        ]
        for params in cases:
            response = await client.get("/admin/billing/report", params=params, headers=admin_headers)
            assert response.status_code == 400, (params, response.text)
            assert response.headers["content-type"].startswith("application/problem+json")

    async def test_an_empty_period_is_zero(self, client: Client, admin_headers: dict[str, str]) -> None:
        body = await report(client, admin_headers, NOW - timedelta(hours=1), NOW)
        assert body["rows"] == []
        assert body["totals"]["requests"] == 0
        assert body["totals"]["cost_total"] == "0.000000"
        assert body["totals"]["cache_hit_rate"] == 0


# --- property: the SQL aggregation agrees with a plain loop over the rows, across versions and period edges ------

T0 = datetime(2026, 11, 1, tzinfo=UTC)
MODELS = ("m1", "m2")
TIERS = ("default", "flex", "priority")
price_amounts = st.integers(min_value=0, max_value=10**12).map(lambda n: Decimal(n).scaleb(-9))


@st.composite
def book_and_rows(
    draw: st.DrawFn,
) -> tuple[list[tuple[str, str, int, Decimal, Decimal, Decimal]], list[tuple[Any, ...]]]:
    versions = []
    for model in MODELS:
        for tier in TIERS:
            for minute in draw(st.lists(st.integers(0, 30), max_size=3 if tier == "default" else 2, unique=True)):
                input_price = draw(price_amounts)
                cached_price, output_price = draw(price_amounts).min(input_price), draw(price_amounts)
                versions.append((model, tier, minute, input_price, cached_price, output_price))
    rows = []
    for _ in range(draw(st.integers(0, 25))):
        prompt = draw(st.integers(0, 10**6))
        rows.append(
            (
                draw(st.sampled_from(MODELS)),
                draw(st.integers(-2, 32)),  # minute
                draw(st.integers(-1, 1)),  # microseconds off the minute
                prompt,
                draw(st.integers(0, prompt)),
                draw(st.integers(0, 10**6)),
                draw(st.integers(0, 1)),  # tenant index
                draw(st.sampled_from((None, 0, 1))),  # endpoint index
                draw(st.sampled_from(TIERS)),
            )
        )
    return versions, rows


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    data=book_and_rows(),
    group_by=st.sampled_from(list(GroupBy)),
    edges=st.tuples(st.integers(-3, 31), st.integers(1, 36)),
)
async def test_sql_rating_matches_a_loop_over_the_rows(
    sessions: Sessions,
    tenants: list[Tenant],
    data: tuple[list[tuple[str, str, int, Decimal, Decimal, Decimal]], list[tuple[Any, ...]]],
    group_by: GroupBy,
    edges: tuple[int, int],
) -> None:
    versions, rows = data
    endpoints = [uuid.UUID(int=1), uuid.UUID(int=2)]
    start = T0 + timedelta(minutes=edges[0])
    end = start + timedelta(minutes=edges[1])
    usage_rows = []
    for model, minute, micros, prompt, cached, completion, tenant_index, endpoint_index, tier in rows:
        tenant = tenants[tenant_index]
        endpoint = None if endpoint_index is None else endpoints[endpoint_index]
        usage_rows.append(
            usage(
                tenant,
                T0 + timedelta(minutes=minute, microseconds=micros),
                base_model=model,
                model=model if endpoint is None else f"endpoint-{endpoint_index}",
                endpoint_id=endpoint,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                service_tier=tier,
            )
        )

    # The oracle: row by row, the version found by scanning the book (the row's tier, else default), exact Decimal
    # arithmetic.
    expected: dict[tuple[Any, ...], dict[str, Decimal]] = {}
    with localcontext() as context:
        context.prec = 200
        for row in usage_rows:
            if not start <= row["started_at"] < end:
                continue
            started = [
                v for v in versions if v[0] == row["base_model"] and T0 + timedelta(minutes=v[2]) <= row["started_at"]
            ]
            found = [v for v in started if v[1] == row["service_tier"]] or [v for v in started if v[1] == "default"]
            if group_by is GroupBy.TENANT:
                name = next(t.name for t in tenants if t.id == row["tenant_id"])
                key: tuple[Any, ...] = (name, str(row["tenant_id"]))
            elif group_by is GroupBy.ENDPOINT:
                endpoint_id = row["endpoint_id"]
                key = (str(row["tenant_id"]), None if endpoint_id is None else str(endpoint_id), row["model"])
            elif group_by is GroupBy.MODEL:
                key = (row["base_model"],)
            elif group_by is GroupBy.SERVICE_TIER:
                key = (row["service_tier"],)
            else:
                key = (row["started_at"].date().isoformat(),)
            sums = expected.setdefault(key, {name: Decimal(0) for name in (*MONEY, "requests", "unpriced")})
            sums["requests"] += 1
            if not found:
                sums["unpriced"] += 1
                continue
            _, _, _, input_price, cached_price, output_price = max(found, key=lambda v: v[2])
            uncached_cost = (row["prompt_tokens"] - row["cached_tokens"]) * input_price / 10**6
            cached_cost = row["cached_tokens"] * cached_price / 10**6
            output_cost = row["completion_tokens"] * output_price / 10**6
            sums["cost_uncached"] += uncached_cost
            sums["cost_cached"] += cached_cost
            sums["cost_output"] += output_cost
            sums["cost_total"] += uncached_cost + cached_cost + output_cost
            sums["cache_savings"] += row["cached_tokens"] * input_price / 10**6 - cached_cost

    async with sessions() as session:
        session.add_all(
            PriceVersion(
                base_model=model,
                service_tier=tier,
                input_per_mtok=input_price,
                cached_input_per_mtok=cached_price,
                output_per_mtok=output_price,
                effective_at=T0 + timedelta(minutes=minute),
            )
            for model, tier, minute, input_price, cached_price, output_price in versions
        )
        await UsageRepository(session).add_if_absent(usage_rows)
        await session.flush()
        result = await BillingService(session).report(start=start, end=end, group_by=group_by)
        await session.rollback()

    assert {line.key for line in result.lines} == set(expected)
    exact_total = sum((sums["cost_total"] for sums in expected.values()), Decimal(0))
    assert result.exact_totals.cost_total == exact_total
    assert result.totals.cost_total == exact_total.quantize(Decimal("0.000001"), rounding=ROUND_HALF_EVEN)
    for line in result.lines:
        sums = expected[line.key]
        assert (line.requests, line.unpriced_requests) == (sums["requests"], sums["unpriced"])
        for name in MONEY:
            assert abs(getattr(line, name) - sums[name]) < (3 if name == "cost_total" else 1) * Decimal("0.000001")
    for name in MONEY:
        assert sum((getattr(line, name) for line in result.lines), Decimal(0)) == getattr(result.totals, name)
        assert getattr(result.exact_totals, name) == sum((s[name] for s in expected.values()), Decimal(0))
