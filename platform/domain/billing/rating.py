"""Rating and rounding: pure functions from summed usage and prices to report lines (no database, no clock).

Which price rates a request: the version of its base model and its service tier in force when it started (the
latest `effective_at <= started_at`). When its tier has no version in force then (a tier never priced, or priced
only from later on), the default tier's version in force then rates it; with neither, it is unpriced (counted,
rated 0). So a flex or priority price is optional: until an admin sets one, those tiers cost what default costs
(docs/decisions/0026-service-tiers.md). `PriceBook` is that rule over versions in memory; the repository's SQL
(`BillingUsageRepository.slices`) is the same rule in the database.

Reasoning tokens (completion tokens inside a think block) are output tokens: `output_tokens` counts them, and they
are priced apart, at the version's reasoning price (the output price unless one was set): `cost_output` is the
other output tokens at the output price, `cost_reasoning` the reasoning tokens at the reasoning price, so with the
default reasoning price the two add up to what all output tokens cost at the output price.

Exact amounts are Decimals computed without any rounding (`_EXACT` traps it); money is rounded only in
`round_report`, by the rule in docs/decisions/0011-billing-rounding.md: totals once, half-even; lines by
largest remainder so that every rounded column adds up to its rounded total and each line's parts add up to its
`cost_total`.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Context, Decimal, Inexact, InvalidOperation, Rounded

from loraplex.platform.service_tiers import ServiceTier

TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per million tokens
MONEY_QUANTUM = Decimal("0.000001")  # report money in whole micro-dollars
RATE_QUANTUM = Decimal("0.0001")
CURRENCY = "USD"
DEFAULT_TIER: str = ServiceTier.DEFAULT.value  # the tier whose prices rate a request of a tier without its own

# Exact arithmetic: 60 digits hold any sum of (token count < 2**63) x (price of 15 digits) over billions of rows, and
# a result that would need rounding raises instead of silently losing a fraction of a cent.
_EXACT = Context(prec=60, traps=[InvalidOperation, Inexact, Rounded])
_ROUNDING = Context(prec=60, traps=[InvalidOperation])
_MTOK = Decimal(TOKENS_PER_PRICE_UNIT)
_ZERO = Decimal(0)

GroupKey = tuple[str | None, ...]


class GroupBy(enum.StrEnum):
    TENANT = "tenant"
    ENDPOINT = "endpoint"
    MODEL = "model"
    DAY = "day"
    SERVICE_TIER = "service_tier"

    @property
    def key_names(self) -> tuple[str, ...]:
        """The names of the key fields of a report line, in the order of `Line.key`."""
        return _KEY_NAMES[self]


_KEY_NAMES: dict[GroupBy, tuple[str, ...]] = {
    GroupBy.TENANT: ("tenant_name", "tenant_id"),  # by name first: lines sort by key
    GroupBy.ENDPOINT: ("tenant_id", "endpoint_id", "model"),
    GroupBy.MODEL: ("base_model",),
    GroupBy.DAY: ("day",),
    GroupBy.SERVICE_TIER: ("service_tier",),
}


@dataclass(frozen=True, slots=True)
class PriceTerms:
    """USD per million tokens under one price version."""

    input_per_mtok: Decimal  # prompt tokens the prefix cache did not serve
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal  # completion tokens outside a think block
    reasoning_per_mtok: Decimal | None = None  # completion tokens inside one; None: the output price

    @property
    def reasoning_price(self) -> Decimal:
        return self.output_per_mtok if self.reasoning_per_mtok is None else self.reasoning_per_mtok


@dataclass(frozen=True, slots=True)
class DatedPrice:
    base_model: str
    effective_at: datetime
    terms: PriceTerms
    service_tier: str = DEFAULT_TIER


class PriceBook:
    """Every version of every base model's prices, per service tier; `in_force` answers which one rates a request."""

    def __init__(self, prices: Iterable[DatedPrice]) -> None:
        by_book: dict[tuple[str, str], list[DatedPrice]] = {}
        for price in prices:
            by_book.setdefault((price.base_model, price.service_tier), []).append(price)
        self._versions = {book: sorted(found, key=lambda p: p.effective_at) for book, found in by_book.items()}
        self._starts = {book: [p.effective_at for p in found] for book, found in self._versions.items()}

    def in_force(self, base_model: str, at: datetime, service_tier: str = DEFAULT_TIER) -> DatedPrice | None:
        """The version of `base_model` and `service_tier` with the latest `effective_at <= at`, else the default
        tier's; None when neither had a version started."""
        own = self._latest((base_model, service_tier), at)
        if own is not None or service_tier == DEFAULT_TIER:
            return own
        return self._latest((base_model, DEFAULT_TIER), at)

    def _latest(self, book: tuple[str, str], at: datetime) -> DatedPrice | None:
        starts = self._starts.get(book)
        if not starts:
            return None
        index = bisect.bisect_right(starts, at) - 1
        return self._versions[book][index] if index >= 0 else None


@dataclass(frozen=True, slots=True)
class UsageSlice:
    """The summed usage of one report group under one price version (`terms` None: no price was in force)."""

    key: GroupKey
    terms: PriceTerms | None
    requests: int
    input_uncached_tokens: int
    input_cached_tokens: int
    output_tokens: int  # reasoning tokens included
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Line:
    """One report line (or the totals, with `key` empty). Money is exact from `rate`, rounded from `round_report`."""

    key: GroupKey
    requests: int = 0
    unpriced_requests: int = 0  # requests with no price in force for their base model: counted, rated 0
    input_uncached_tokens: int = 0
    input_cached_tokens: int = 0
    output_tokens: int = 0  # reasoning tokens included
    reasoning_tokens: int = 0
    cost_uncached: Decimal = field(default=_ZERO)
    cost_cached: Decimal = field(default=_ZERO)
    cost_output: Decimal = field(default=_ZERO)  # the output tokens that are not reasoning tokens
    cost_reasoning: Decimal = field(default=_ZERO)
    cost_total: Decimal = field(default=_ZERO)
    # What the cached tokens would have cost at the input price, minus what they cost.
    cache_savings: Decimal = field(default=_ZERO)

    @property
    def cache_hit_rate(self) -> Decimal:
        """Cached share of the prompt tokens, to 4 decimals (0 when there were none)."""
        prompt = self.input_uncached_tokens + self.input_cached_tokens
        if prompt == 0:
            return _ZERO.quantize(RATE_QUANTUM)
        return (Decimal(self.input_cached_tokens) / Decimal(prompt)).quantize(
            RATE_QUANTUM, rounding=ROUND_HALF_EVEN, context=_ROUNDING
        )

    def plus(self, other: Line) -> Line:
        """Exact sums of both (keeps this line's key)."""
        add = _EXACT.add
        return replace(
            self,
            requests=self.requests + other.requests,
            unpriced_requests=self.unpriced_requests + other.unpriced_requests,
            input_uncached_tokens=self.input_uncached_tokens + other.input_uncached_tokens,
            input_cached_tokens=self.input_cached_tokens + other.input_cached_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
            cost_uncached=add(self.cost_uncached, other.cost_uncached),
            cost_cached=add(self.cost_cached, other.cost_cached),
            cost_output=add(self.cost_output, other.cost_output),
            cost_reasoning=add(self.cost_reasoning, other.cost_reasoning),
            cost_total=add(self.cost_total, other.cost_total),
            cache_savings=add(self.cache_savings, other.cache_savings),
        )


def cost(tokens: int, per_mtok: Decimal) -> Decimal:
    """The exact price of `tokens` at `per_mtok` USD per million tokens."""
    return _EXACT.divide(_EXACT.multiply(Decimal(tokens), per_mtok), _MTOK)


def rate_slice(piece: UsageSlice) -> Line:
    """The exact cost of one slice. Rating is linear, so a slice's sums rate the same as its rows one by one."""
    if piece.terms is None:
        return Line(
            key=piece.key,
            requests=piece.requests,
            unpriced_requests=piece.requests,
            input_uncached_tokens=piece.input_uncached_tokens,
            input_cached_tokens=piece.input_cached_tokens,
            output_tokens=piece.output_tokens,
            reasoning_tokens=piece.reasoning_tokens,
        )
    terms = piece.terms
    uncached = cost(piece.input_uncached_tokens, terms.input_per_mtok)
    cached = cost(piece.input_cached_tokens, terms.cached_input_per_mtok)
    output = cost(piece.output_tokens - piece.reasoning_tokens, terms.output_per_mtok)
    reasoning = cost(piece.reasoning_tokens, terms.reasoning_price)
    at_input_price = cost(piece.input_cached_tokens, terms.input_per_mtok)
    return Line(
        key=piece.key,
        requests=piece.requests,
        input_uncached_tokens=piece.input_uncached_tokens,
        input_cached_tokens=piece.input_cached_tokens,
        output_tokens=piece.output_tokens,
        reasoning_tokens=piece.reasoning_tokens,
        cost_uncached=uncached,
        cost_cached=cached,
        cost_output=output,
        cost_reasoning=reasoning,
        cost_total=_sum((uncached, cached, output, reasoning)),
        cache_savings=_EXACT.subtract(at_input_price, cached),
    )


def _sort_key(key: GroupKey) -> tuple[tuple[bool, str], ...]:
    return tuple((part is None, part or "") for part in key)


def rate(slices: Iterable[UsageSlice]) -> list[Line]:
    """Exact lines, one per group key (slices of one key under several price versions are summed), sorted by key
    with missing parts (None) last."""
    lines: dict[GroupKey, Line] = {}
    for piece in slices:
        rated = rate_slice(piece)
        found = lines.get(piece.key)
        lines[piece.key] = rated if found is None else found.plus(rated)
    return [lines[key] for key in sorted(lines, key=_sort_key)]


def total(lines: Iterable[Line]) -> Line:
    """The exact sum of `lines` (empty key)."""
    result = Line(key=())
    for line in lines:
        result = result.plus(line)
    return replace(result, key=())


def _sum(amounts: Iterable[Decimal]) -> Decimal:
    result = _ZERO
    for amount in amounts:
        result = _EXACT.add(result, amount)
    return result


def round_half_even(amount: Decimal, quantum: Decimal = MONEY_QUANTUM) -> Decimal:
    return amount.quantize(quantum, rounding=ROUND_HALF_EVEN, context=_ROUNDING)


def allocate(exact: Sequence[Decimal], target: Decimal, quantum: Decimal = MONEY_QUANTUM) -> list[Decimal]:
    """Round each of `exact` down or up to a multiple of `quantum` so that the results add up to `target` (largest
    remainder): every part starts at its floor, then the parts with the largest remainders get one quantum more,
    earlier parts first among equal remainders. `target` must be a multiple of `quantum` reachable that way (it is
    when it is sum(exact) rounded to `quantum` in any direction); ValueError otherwise."""
    floors = [amount.quantize(quantum, rounding=ROUND_FLOOR, context=_ROUNDING) for amount in exact]
    remainders = [_ROUNDING.subtract(amount, floor) for amount, floor in zip(exact, floors, strict=True)]
    extra = _ROUNDING.subtract(target, _sum(floors))
    units = int(_ROUNDING.divide_int(extra, quantum))
    candidates = [i for i, remainder in enumerate(remainders) if remainder > 0]
    if _ROUNDING.multiply(Decimal(units), quantum) != extra or not 0 <= units <= len(candidates):
        raise ValueError(f"{target} is not a rounding of {len(exact)} amounts adding up to {_sum(exact)}")
    candidates.sort(key=lambda i: (-remainders[i], i))
    for i in candidates[:units]:
        floors[i] = _ROUNDING.add(floors[i], quantum)
    return floors


# The parts a line's cost_total is the sum of, in report order.
_COST_PARTS = ("cost_uncached", "cost_cached", "cost_output", "cost_reasoning")


@dataclass(frozen=True, slots=True)
class RoundedReport:
    lines: list[Line]
    totals: Line
    exact_totals: Line


def round_report(lines: Sequence[Line], quantum: Decimal = MONEY_QUANTUM) -> RoundedReport:
    """Round the money of exact `lines` (docs/decisions/0011-billing-rounding.md):

    1. `cost_total` of the totals is the exact grand total rounded half-even; that is the one rounding.
    2. The totals' four parts (uncached, cached, output, reasoning) are that rounded total split by largest
       remainder, so each is its exact column sum rounded down or up and the four add up to the rounded total.
    3. Each part column's lines are that column's rounded total split by largest remainder over the lines.
    4. A line's `cost_total` is the sum of its rounded parts.
    `cache_savings` stands apart (it is not part of the cost): its total is rounded half-even, its lines allocated.

    So every rounded column adds up to its rounded total, each line's parts add up to its `cost_total`, each part
    is within one quantum of its exact value and each line's `cost_total` within four.
    """
    exact_totals = total(lines)
    grand = round_half_even(exact_totals.cost_total, quantum)
    parts = _COST_PARTS
    part_totals = allocate([getattr(exact_totals, name) for name in parts], grand, quantum)
    columns = [
        allocate([getattr(line, name) for line in lines], part_total, quantum)
        for name, part_total in zip(parts, part_totals, strict=True)
    ]
    savings_total = round_half_even(exact_totals.cache_savings, quantum)
    savings = allocate([line.cache_savings for line in lines], savings_total, quantum)
    rounded = [
        replace(
            line,
            cost_uncached=uncached,
            cost_cached=cached,
            cost_output=output,
            cost_reasoning=reasoning,
            cost_total=_ROUNDING.add(_ROUNDING.add(_ROUNDING.add(uncached, cached), output), reasoning),
            cache_savings=saved,
        )
        for line, uncached, cached, output, reasoning, saved in zip(lines, *columns, savings, strict=True)
    ]
    totals = replace(
        exact_totals,
        cost_uncached=part_totals[0],
        cost_cached=part_totals[1],
        cost_output=part_totals[2],
        cost_reasoning=part_totals[3],
        cost_total=grand,
        cache_savings=savings_total,
    )
    return RoundedReport(lines=rounded, totals=totals, exact_totals=exact_totals)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """The fields of one usage row that rating needs (for rating rows held in memory)."""

    base_model: str
    started_at: datetime
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    service_tier: str = DEFAULT_TIER
    reasoning_tokens: int = 0  # part of completion_tokens


def slices_of(rows: Iterable[UsageRow], book: PriceBook, key_of: Callable[[UsageRow], GroupKey]) -> list[UsageSlice]:
    """Sum rows held in memory into slices by (group key, price version in force when the request started): the
    same slices the repository's SQL aggregation returns for rows in the database."""
    sums: dict[tuple[GroupKey, PriceTerms | None], list[int]] = {}
    for row in rows:
        price = book.in_force(row.base_model, row.started_at, row.service_tier)
        found = sums.setdefault((key_of(row), None if price is None else price.terms), [0, 0, 0, 0, 0])
        found[0] += 1
        found[1] += row.prompt_tokens - row.cached_tokens
        found[2] += row.cached_tokens
        found[3] += row.completion_tokens
        found[4] += row.reasoning_tokens
    return [UsageSlice(key, terms, *counts) for (key, terms), counts in sums.items()]


def line_fields(line: Line) -> Mapping[str, int | Decimal]:
    """The numbers of a line by report field name, in report order."""
    return {
        "requests": line.requests,
        "unpriced_requests": line.unpriced_requests,
        "input_uncached_tokens": line.input_uncached_tokens,
        "input_cached_tokens": line.input_cached_tokens,
        "output_tokens": line.output_tokens,
        "reasoning_tokens": line.reasoning_tokens,
        "cache_hit_rate": line.cache_hit_rate,
        "cost_uncached": line.cost_uncached,
        "cost_cached": line.cost_cached,
        "cost_output": line.cost_output,
        "cost_reasoning": line.cost_reasoning,
        "cost_total": line.cost_total,
        "cache_savings": line.cache_savings,
    }
