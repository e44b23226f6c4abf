"""Rating and rounding without a database: which price rates a request, exact costs, the rounding rule of
docs/decisions/0011-billing-rounding.md, and the CSV form of a report."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.domain.billing.models import PriceVersion
from loraplex.platform.domain.billing.rating import (
    MONEY_QUANTUM,
    DatedPrice,
    GroupBy,
    GroupKey,
    Line,
    PriceBook,
    PriceTerms,
    UsageRow,
    UsageSlice,
    allocate,
    rate,
    round_report,
    slices_of,
)
from loraplex.platform.domain.billing.schemas import BillingReportOut, report_csv
from loraplex.platform.domain.billing.service import BillingReport, BillingService, default_cached_price
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.repository import UsageRepository

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 1, tzinfo=UTC)
Q = MONEY_QUANTUM
MONEY = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning", "cost_total", "cache_savings")
PARTS = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning")


def terms(input_price: str, cached: str, output: str) -> PriceTerms:
    return PriceTerms(Decimal(input_price), Decimal(cached), Decimal(output))


def line(key: str, **amounts: str) -> Line:
    values = {name: Decimal(amounts.get(name, "0")) for name in MONEY}
    return Line(key=(key,), requests=1, **values)


class TestPriceBook:
    def test_a_version_is_in_force_from_its_instant_until_the_next(self) -> None:
        old = DatedPrice("m", T0, terms("1", "0.1", "2"))
        new = DatedPrice("m", T0 + timedelta(hours=1), terms("3", "0.3", "6"))
        book = PriceBook([new, old])
        assert book.in_force("m", T0 - timedelta(microseconds=1)) is None
        assert book.in_force("m", T0) is old
        assert book.in_force("m", T0 + timedelta(hours=1) - timedelta(microseconds=1)) is old
        assert book.in_force("m", T0 + timedelta(hours=1)) is new
        assert book.in_force("m", T0 + timedelta(days=400)) is new
        assert book.in_force("other", T0) is None

    def test_a_tier_without_a_version_in_force_is_rated_by_the_default_tiers(self) -> None:
        default = DatedPrice("m", T0, terms("1", "0.1", "2"))
        later_default = DatedPrice("m", T0 + timedelta(hours=2), terms("5", "0.5", "10"))
        flex = DatedPrice("m", T0 + timedelta(hours=1), terms("0.5", "0.05", "1"), service_tier="flex")
        book = PriceBook([later_default, flex, default])
        # Before flex's first version: the default tier's version then in force.
        assert book.in_force("m", T0, "flex") is default
        assert book.in_force("m", T0 + timedelta(hours=1) - timedelta(microseconds=1), "flex") is default
        # From it on: flex's own, even once a newer default version is in force.
        assert book.in_force("m", T0 + timedelta(hours=1), "flex") is flex
        assert book.in_force("m", T0 + timedelta(hours=3), "flex") is flex
        # Priority never priced: always the default tier's; default never sees flex's.
        assert book.in_force("m", T0 + timedelta(hours=3), "priority") is later_default
        assert book.in_force("m", T0 + timedelta(hours=1), "default") is default
        assert book.in_force("m", T0 - timedelta(microseconds=1), "flex") is None


class TestRate:
    def test_costs_are_exact_per_million_tokens(self) -> None:
        [rated] = rate([UsageSlice(("t",), terms("0.15", "0.015", "0.6"), 3, 1_000, 3_000, 7)])
        assert rated.cost_uncached == Decimal("0.00015")
        assert rated.cost_cached == Decimal("0.000045")
        assert rated.cost_output == Decimal("0.0000042")
        assert rated.cost_total == Decimal("0.0001992")
        assert rated.cache_savings == Decimal("0.000405")  # 3000 tokens x (0.15 - 0.015) / 1M
        assert rated.cache_hit_rate == Decimal("0.7500")

    def test_slices_of_one_group_under_two_versions_make_one_line(self) -> None:
        lines = rate(
            [
                UsageSlice(("t",), terms("1", "0.1", "1"), 1, 1_000_000, 0, 0),
                UsageSlice(("t",), terms("2", "0.2", "2"), 1, 1_000_000, 0, 0),
                UsageSlice(("s",), None, 4, 10, 10, 10),
            ]
        )
        assert [(x.key, x.requests, x.unpriced_requests, x.cost_total) for x in lines] == [
            (("s",), 4, 4, Decimal(0)),
            (("t",), 2, 0, Decimal(3)),
        ]

    def test_huge_counts_stay_exact(self) -> None:
        [rated] = rate([UsageSlice(("t",), terms("999999.999999999", "0.000000001", "1"), 1, 2**62, 2**62, 0)])
        # 2**62 x 0.999999999999999 = 2**62 - 2**62 / 10**15, to the last digit (28-digit arithmetic would round)
        assert rated.cost_uncached == Decimal("4611686018427383292.313981572612096")

    def test_no_prompt_tokens_is_a_zero_hit_rate(self) -> None:
        assert Line(key=()).cache_hit_rate == 0


class TestAllocate:
    def test_largest_remainders_get_the_extra_quanta(self) -> None:
        exact = [Decimal("0.0000004"), Decimal("0.0000007"), Decimal("0.0000004")]
        assert allocate(exact, Decimal("0.000002")) == [Decimal("0.000001"), Decimal("0.000001"), Decimal(0)]

    def test_equal_remainders_go_to_the_earlier_lines(self) -> None:
        exact = [Decimal("0.0000004")] * 3  # 0.0000012 in all, rounds to 0.000001
        assert allocate(exact, Decimal("0.000001")) == [Decimal("0.000001"), Decimal(0), Decimal(0)]

    def test_a_line_on_a_whole_quantum_is_never_moved(self) -> None:
        exact = [Decimal("0.000002"), Decimal("0.0000005"), Decimal("0.0000005")]
        assert allocate(exact, Decimal("0.000003")) == [Decimal("0.000002"), Decimal("0.000001"), Decimal(0)]

    def test_an_unreachable_target_is_refused(self) -> None:
        with pytest.raises(ValueError, match="not a rounding"):
            allocate([Decimal("0.000001"), Decimal("0.000002")], Decimal("0.000004"))
        with pytest.raises(ValueError, match="not a rounding"):
            allocate([Decimal("0.0000015")], Decimal("0.0000015"))


class TestRoundReport:
    def test_three_thirds_add_up_to_the_rounded_whole(self) -> None:
        third = "0.0000003333333333"
        report = round_report([line(k, cost_uncached=third, cost_total=third) for k in "abc"])
        assert report.totals.cost_total == Decimal("0.000001")
        assert [x.cost_total for x in report.lines] == [Decimal("0.000001"), Decimal(0), Decimal(0)]

    def test_the_total_rounds_half_to_even_once(self) -> None:
        half = "0.0000005"
        report = round_report([line("a", cost_output=half, cost_total=half)])
        assert report.totals.cost_total == 0  # half to even: 0.000000, not 0.000001
        report = round_report([line(k, cost_output=half, cost_total=half) for k in "abc"])
        assert report.totals.cost_total == Decimal("0.000002")  # 0.0000015 -> 0.000002
        assert sum(x.cost_total for x in report.lines) == Decimal("0.000002")

    def test_parts_add_up_to_each_lines_total(self) -> None:
        report = round_report(
            [
                line(
                    "a",
                    cost_uncached="0.0000006",
                    cost_cached="0.0000006",
                    cost_output="0.0000006",
                    cost_total="0.0000018",
                ),
                line(
                    "b",
                    cost_uncached="0.0000004",
                    cost_cached="0.0000004",
                    cost_output="0.0000004",
                    cost_total="0.0000012",
                ),
            ]
        )
        for rounded in [*report.lines, report.totals]:
            assert rounded.cost_uncached + rounded.cost_cached + rounded.cost_output == rounded.cost_total
        assert report.totals.cost_total == Decimal("0.000003")


class TestDefaultCachedPrice:
    @pytest.mark.parametrize(
        ("input_price", "cached"),
        [("0.15", "0.015"), ("3", "0.3"), ("0", "0"), ("0.000000015", "0.000000002"), ("0.000000025", "0.000000002")],
    )
    def test_a_tenth_rounded_half_even_to_nine_decimals(self, input_price: str, cached: str) -> None:
        assert default_cached_price(Decimal(input_price)) == Decimal(cached)


def _report(lines: list[Line], group_by: GroupBy) -> BillingReport:
    rounded = round_report(lines)
    return BillingReport(
        start=T0,
        end=T0 + timedelta(days=1),
        group_by=group_by,
        currency="USD",
        lines=rounded.lines,
        totals=rounded.totals,
        exact_totals=rounded.exact_totals,
    )


class TestCsv:
    def test_header_groups_and_totals_with_quoting(self) -> None:
        lines = rate(
            [
                UsageSlice(("t1", "e1", 'bot, "the" one'), terms("1", "0.1", "2"), 2, 1000, 500, 10),
                UsageSlice(("t1", None, "=HYPERLINK(1)"), None, 1, 5, 0, 5),
            ]
        )
        text = report_csv(_report(lines, GroupBy.ENDPOINT))
        assert '"bot, ""the"" one"' in text  # RFC 4180 quoting
        rows = list(csv.reader(io.StringIO(text)))
        assert rows[0][:4] == ["tenant_id", "endpoint_id", "model", "requests"]
        assert rows[0][-6:] == list(MONEY)
        assert [r[:3] for r in rows[1:]] == [
            ["t1", "e1", 'bot, "the" one'],
            ["t1", "", "'=HYPERLINK(1)"],  # a spreadsheet would run it as a formula
            ["total", "", ""],
        ]
        header = rows[0]
        totals = dict(zip(header, rows[-1], strict=True))
        assert totals["requests"] == "3"
        assert totals["unpriced_requests"] == "1"
        assert totals["cost_total"] == "0.001070"  # 1000 x 1 + 500 x 0.1 + 10 x 2, per million
        assert totals["cache_hit_rate"] == "0.3322"

    def test_json_rows_carry_their_group_keys_first(self) -> None:
        lines = rate([UsageSlice(("2026-11-01",), terms("1", "0.1", "2"), 1, 1, 1, 1)])
        body = BillingReportOut.of(_report(lines, GroupBy.DAY)).model_dump(mode="json")
        assert list(body["rows"][0])[:2] == ["day", "requests"]
        assert body["rows"][0]["cost_total"] == "0.000003"
        assert body["totals"]["cost_total"] == "0.000003"
        assert "day" not in body["totals"]


# --- property: the rated, rounded report agrees with a plain loop over the rows -------------------------------

MODELS = ("m1", "m2", "m3")
TIERS = ("default", "flex", "priority")
GRID_MINUTES = 40  # a coarse clock, so rows start exactly on price changes and period edges often


@dataclass(frozen=True)
class GenRow:
    tenant: str
    endpoint: str | None
    row: UsageRow


prices_strategy = st.integers(min_value=0, max_value=10**12).map(lambda n: Decimal(n).scaleb(-9))


@st.composite
def price_versions(draw: st.DrawFn) -> list[DatedPrice]:
    versions: list[DatedPrice] = []
    for model in MODELS:
        for tier in TIERS:
            minutes = draw(st.lists(st.integers(0, GRID_MINUTES), max_size=4 if tier == "default" else 2, unique=True))
            for minute in minutes:
                input_price = draw(prices_strategy)
                cached = draw(st.one_of(st.just(default_cached_price(input_price)), prices_strategy)).min(input_price)
                at = T0 + timedelta(minutes=minute)
                reasoning = draw(st.one_of(st.none(), prices_strategy))  # None: the output price
                terms = PriceTerms(input_price, cached, draw(prices_strategy), reasoning)
                versions.append(DatedPrice(model, at, terms, tier))
    return versions


@st.composite
def usage_rows(draw: st.DrawFn) -> list[GenRow]:
    rows: list[GenRow] = []
    for _ in range(draw(st.integers(0, 40))):
        prompt = draw(st.integers(0, 200_000))
        completion = draw(st.integers(0, 100_000))
        started = T0 + timedelta(minutes=draw(st.integers(-2, GRID_MINUTES + 2)))
        if draw(st.booleans()):
            started += timedelta(microseconds=draw(st.integers(-1, 1)))
        usage = UsageRow(
            base_model=draw(st.sampled_from(MODELS)),
            started_at=started,
            prompt_tokens=prompt,
            cached_tokens=draw(st.integers(0, prompt)),
            completion_tokens=completion,
            service_tier=draw(st.sampled_from(TIERS)),
            reasoning_tokens=draw(st.one_of(st.just(0), st.integers(0, completion))),
        )
        rows.append(GenRow(draw(st.sampled_from(("t1", "t2"))), draw(st.sampled_from(("e1", "e2", None))), usage))
    return rows


def key_function(group_by: GroupBy, tenant_of: dict[int, GenRow]) -> Callable[[UsageRow], GroupKey]:
    def key(row: UsageRow) -> GroupKey:
        gen = tenant_of[id(row)]
        if group_by is GroupBy.TENANT:
            return (gen.tenant.upper(), gen.tenant)
        if group_by is GroupBy.ENDPOINT:
            return (gen.tenant, gen.endpoint, gen.endpoint or row.base_model)
        if group_by is GroupBy.MODEL:
            return (row.base_model,)
        if group_by is GroupBy.SERVICE_TIER:
            return (row.service_tier,)
        return (row.started_at.date().isoformat(),)

    return key


def expected_by_loop(
    rows: list[GenRow], prices: list[DatedPrice], key: Callable[[UsageRow], GroupKey], start: datetime, end: datetime
) -> dict[GroupKey, dict[str, Decimal]]:
    """The oracle: each row on its own, its price found by scanning every version (of its tier, else of the default
    tier), costs in exact Decimals."""
    out: dict[GroupKey, dict[str, Decimal]] = {}
    with localcontext() as context:
        context.prec = 200
        for gen in rows:
            row = gen.row
            if not start <= row.started_at < end:
                continue
            in_force: DatedPrice | None = None
            for tier in (row.service_tier, "default"):
                for price in prices:
                    applies = price.base_model == row.base_model and price.effective_at <= row.started_at
                    applies = applies and price.service_tier == tier
                    if applies and (in_force is None or price.effective_at > in_force.effective_at):
                        in_force = price
                if in_force is not None:
                    break
            sums = out.setdefault(
                key(row), {name: Decimal(0) for name in (*MONEY, "requests", "unpriced", "reasoning_tokens")}
            )
            sums["requests"] += 1
            if in_force is None:
                sums["reasoning_tokens"] += row.reasoning_tokens
                sums["unpriced"] += 1
                continue
            p = in_force.terms
            uncached = Decimal(row.prompt_tokens - row.cached_tokens) * p.input_per_mtok / 1_000_000
            cached = Decimal(row.cached_tokens) * p.cached_input_per_mtok / 1_000_000
            output = Decimal(row.completion_tokens - row.reasoning_tokens) * p.output_per_mtok / 1_000_000
            reasoning_price = p.output_per_mtok if p.reasoning_per_mtok is None else p.reasoning_per_mtok
            reasoning = Decimal(row.reasoning_tokens) * reasoning_price / 1_000_000
            sums["cost_uncached"] += uncached
            sums["cost_cached"] += cached
            sums["cost_output"] += output
            sums["cost_reasoning"] += reasoning
            sums["cost_total"] += uncached + cached + output + reasoning
            sums["reasoning_tokens"] += row.reasoning_tokens
            sums["cache_savings"] += Decimal(row.cached_tokens) * p.input_per_mtok / 1_000_000 - cached
    return out


def check_rounding(exact_lines: list[Line], report_lines: list[Line], totals: Line, exact_totals: Line) -> None:
    """The rule of decision 0011, as a user with a spreadsheet would check it."""
    assert totals.cost_total == exact_totals.cost_total.quantize(Q, rounding=ROUND_HALF_EVEN)
    assert totals.cache_savings == exact_totals.cache_savings.quantize(Q, rounding=ROUND_HALF_EVEN)
    for name in MONEY:
        assert sum((getattr(x, name) for x in report_lines), Decimal(0)) == getattr(totals, name), name
    for rounded, exact in [*zip(report_lines, exact_lines, strict=True), (totals, exact_totals)]:
        assert sum((getattr(rounded, name) for name in PARTS), Decimal(0)) == rounded.cost_total
        for name in (*PARTS, "cache_savings"):
            assert abs(getattr(rounded, name) - getattr(exact, name)) < Q, name
            assert getattr(rounded, name) % Q == 0
        assert abs(rounded.cost_total - exact.cost_total) < len(PARTS) * Q


@settings(max_examples=300, deadline=None)
@given(
    prices=price_versions(),
    rows=usage_rows(),
    group_by=st.sampled_from(list(GroupBy)),
    edges=st.tuples(st.integers(-3, GRID_MINUTES + 3), st.integers(1, GRID_MINUTES + 6)),
)
def test_report_matches_a_loop_over_the_rows(
    prices: list[DatedPrice], rows: list[GenRow], group_by: GroupBy, edges: tuple[int, int]
) -> None:
    start = T0 + timedelta(minutes=edges[0])
    end = start + timedelta(minutes=edges[1])
    by_id = {id(gen.row): gen for gen in rows}
    key = key_function(group_by, by_id)
    expected = expected_by_loop(rows, prices, key, start, end)

    in_range = [gen.row for gen in rows if start <= gen.row.started_at < end]
    exact_lines = rate(slices_of(in_range, PriceBook(prices), key))
    report = round_report(exact_lines)

    assert {x.key for x in exact_lines} == set(expected)
    for exact in exact_lines:
        sums = expected[exact.key]
        assert exact.requests == sums["requests"]
        assert exact.unpriced_requests == sums["unpriced"]
        assert exact.reasoning_tokens == sums["reasoning_tokens"]
        for name in MONEY:
            assert getattr(exact, name) == sums[name], name
    for name in MONEY:
        assert getattr(report.exact_totals, name) == sum((s[name] for s in expected.values()), Decimal(0))
    check_rounding(exact_lines, report.lines, report.totals, report.exact_totals)


class TestOnSqlite:
    """The embedded mode's database runs the same SQL aggregation (window function, UTC days)."""

    async def test_sql_slices_match_the_in_memory_ones(self, tmp_path: Path) -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
        try:
            await upgrade(engine)
            sessions = create_session_factory(engine)
            prices = [
                DatedPrice("m1", T0, terms("0.123456789", "0.012345679", "999999.999999999")),
                DatedPrice(
                    "m1", T0 + timedelta(minutes=10), PriceTerms(Decimal(2), Decimal("0.2"), Decimal(8), Decimal(3))
                ),
                DatedPrice("m1", T0 + timedelta(minutes=5), terms("0.5", "0.05", "2"), service_tier="flex"),
            ]
            minutes = (-1, 0, 9, 10, 11, 24 * 60)
            rows = [
                UsageRow("m1", T0 + timedelta(minutes=m, microseconds=-1), 1000 + m, 300, 50, reasoning_tokens=m % 50)
                for m in minutes
            ]
            rows.append(UsageRow("m2", T0 + timedelta(minutes=5), 10, 0, 10))
            # flex before its own price (the default tier's), after it (its own), and priority (never priced).
            rows += [UsageRow("m1", T0 + timedelta(minutes=m), 700, 100, 30, "flex") for m in (4, 5, 12)]
            rows.append(UsageRow("m1", T0 + timedelta(minutes=12), 700, 100, 30, "priority"))
            async with sessions() as session:
                tenant = Tenant(name="acme")
                session.add(tenant)
                await session.flush()
                session.add_all(
                    PriceVersion(
                        base_model=p.base_model,
                        service_tier=p.service_tier,
                        input_per_mtok=p.terms.input_per_mtok,
                        cached_input_per_mtok=p.terms.cached_input_per_mtok,
                        output_per_mtok=p.terms.output_per_mtok,
                        # Not given: the output price, as PriceTerms reads None.
                        **(
                            {}
                            if p.terms.reasoning_per_mtok is None
                            else {"reasoning_per_mtok": p.terms.reasoning_per_mtok}
                        ),
                        effective_at=p.effective_at,
                    )
                    for p in prices
                )
                await UsageRepository(session).add_if_absent(
                    [
                        {
                            "request_id": f"r{i}",
                            "tenant_id": tenant.id,
                            "model": row.base_model,
                            "base_model": row.base_model,
                            "prompt_tokens": row.prompt_tokens,
                            "cached_tokens": row.cached_tokens,
                            "completion_tokens": row.completion_tokens,
                            "reasoning_tokens": row.reasoning_tokens,
                            "status": "ok",
                            "service_tier": row.service_tier,
                            "started_at": row.started_at,
                            "finished_at": row.started_at,
                        }
                        for i, row in enumerate(rows)
                    ]
                )
                await session.commit()
                start, end = T0 - timedelta(days=1), T0 + timedelta(days=2)
                for group_by, key in (
                    (GroupBy.DAY, lambda r: (r.started_at.date().isoformat(),)),
                    (GroupBy.MODEL, lambda r: (r.base_model,)),
                    (GroupBy.SERVICE_TIER, lambda r: (r.service_tier,)),
                ):
                    found = await BillingService(session).report(start=start, end=end, group_by=group_by)
                    wanted = round_report(rate(slices_of(rows, PriceBook(prices), key)))
                    # The database stores the output price where no reasoning price was set; rated the same.
                    assert found.lines == wanted.lines
                    assert found.exact_totals == wanted.exact_totals
                    assert found.totals.unpriced_requests == 3  # two started before T0, and m2 has no price
        finally:
            await engine.dispose()
