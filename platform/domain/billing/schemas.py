"""Billing shapes at the edge: price versions, and the billing report as JSON
`{start, end, group_by, currency, rows, totals}` or as CSV. Money is a decimal string, never a JSON number."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from loraplex.platform.domain.base_models.schemas import ModelName
from loraplex.platform.domain.billing.models import PRICE_PRECISION, PRICE_SCALE, PriceVersion
from loraplex.platform.domain.billing.rating import MONEY_QUANTUM, GroupBy, Line, line_fields
from loraplex.platform.domain.billing.service import BillingReport
from loraplex.platform.schemas import RequestBody, from_json_string
from loraplex.platform.service_tiers import ServiceTier

# USD per million tokens; a JSON string ("0.15") or number. At most 9 decimals: more is refused, not rounded.
Price = Annotated[
    Decimal,
    Field(
        ge=0,
        lt=Decimal(10) ** (PRICE_PRECISION - PRICE_SCALE),
        decimal_places=PRICE_SCALE,
        allow_inf_nan=False,
    ),
    from_json_string(Decimal, numbers=True),
]


def money(amount: Decimal) -> str:
    """A rounded amount as a decimal string with the report's fixed number of decimals ("0.001250")."""
    return f"{amount.quantize(MONEY_QUANTUM):f}"


def price_text(amount: Decimal) -> str:
    """A price without trailing zeros ("0.15", "3", "0.000125")."""
    text = f"{amount:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class PriceSet(RequestBody):
    """A new version of a base model's prices (USD per million tokens)."""

    base_model: ModelName
    input_per_mtok: Price
    cached_input_per_mtok: Price | None = Field(
        default=None, description="Prompt tokens served from the prefix cache; default a tenth of input_per_mtok."
    )
    output_per_mtok: Price
    reasoning_per_mtok: Price | None = Field(
        default=None,
        description="Reasoning tokens (completion tokens inside a think block); default output_per_mtok.",
    )
    service_tier: Annotated[ServiceTier, from_json_string(ServiceTier)] = Field(
        default=ServiceTier.DEFAULT,
        description="The tier these prices are for. A request of a tier with no version in force is rated by the "
        "default tier's.",
    )
    effective_at: Annotated[datetime, from_json_string(datetime)] | None = Field(
        default=None,
        description="When the version takes effect (default now; without an offset, UTC). Not before the start of "
        "the base model's latest recorded request: rated usage is never re-rated.",
    )
    currency: Literal["USD"] = "USD"

    @field_validator("effective_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


PriceStatus = Literal["scheduled", "current", "superseded"]


class PriceOut(BaseModel):
    id: str
    base_model: str
    service_tier: ServiceTier
    input_per_mtok: str
    cached_input_per_mtok: str
    output_per_mtok: str
    reasoning_per_mtok: str
    currency: str
    effective_at: datetime
    created_at: datetime
    status: PriceStatus  # current: the version rating requests that start now

    @classmethod
    def of(cls, row: PriceVersion, status: PriceStatus) -> PriceOut:
        return cls(
            id=str(row.id),
            base_model=row.base_model,
            service_tier=ServiceTier(row.service_tier),
            input_per_mtok=price_text(row.input_per_mtok),
            cached_input_per_mtok=price_text(row.cached_input_per_mtok),
            output_per_mtok=price_text(row.output_per_mtok),
            reasoning_per_mtok=price_text(row.reasoning_per_mtok),
            currency=row.currency,
            effective_at=row.effective_at,
            created_at=row.created_at,
            status=status,
        )

    @classmethod
    def history(cls, rows: list[PriceVersion], now: datetime) -> list[PriceOut]:
        """`rows` (by base model and tier, newest first) with each one's status at `now`."""
        out: list[PriceOut] = []
        has_current: set[tuple[str, str]] = set()
        for row in rows:
            status: PriceStatus
            book = (row.base_model, row.service_tier)
            if row.effective_at > now:
                status = "scheduled"
            elif book in has_current:
                status = "superseded"
            else:
                status = "current"
                has_current.add(book)
            out.append(cls.of(row, status))
        return out


class PriceList(BaseModel):
    """The price book: per base model and service tier, scheduled versions, the current one and the superseded
    ones, newest first."""

    object: Literal["list"] = "list"
    data: list[PriceOut]


class LineNumbers(BaseModel):
    requests: int
    unpriced_requests: int = Field(description="Requests with no price in force for their base model; rated 0.")
    input_uncached_tokens: int
    input_cached_tokens: int
    output_tokens: int = Field(description="Completion tokens, reasoning tokens included.")
    reasoning_tokens: int = Field(description="The output tokens spent inside a think block.")
    cache_hit_rate: float = Field(description="input_cached_tokens / all prompt tokens, to 4 decimals.")
    cost_uncached: str
    cost_cached: str
    cost_output: str = Field(description="The output tokens that are not reasoning tokens, at the output price.")
    cost_reasoning: str = Field(description="The reasoning tokens, at the reasoning price.")
    cost_total: str
    cache_savings: str = Field(
        description="What the cached tokens would have cost at the input price, minus their cost."
    )

    @staticmethod
    def numbers(line: Line) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = {}
        for name, value in line_fields(line).items():
            if name == "cache_hit_rate":
                out[name] = float(value)
            elif isinstance(value, Decimal):
                out[name] = money(value)
            else:
                out[name] = value
        return out


class TenantKey(BaseModel):
    tenant_name: str | None
    tenant_id: str


class EndpointKey(BaseModel):
    tenant_id: str
    endpoint_id: str | None = Field(description="None for requests that named a base model, not an endpoint.")
    model: str = Field(description="What the requests sent as `model`: the endpoint's name, or the base model's.")


class ModelKey(BaseModel):
    base_model: str


class DayKey(BaseModel):
    day: str = Field(description="The UTC date the requests started, YYYY-MM-DD.")


class ServiceTierKey(BaseModel):
    service_tier: str = Field(description="The service tier the requests ran on.")


# Keys first, then the numbers (pydantic orders fields from the last base class to the first).
class TenantLine(LineNumbers, TenantKey):
    pass


class EndpointLine(LineNumbers, EndpointKey):
    pass


class ModelLine(LineNumbers, ModelKey):
    pass


class DayLine(LineNumbers, DayKey):
    pass


class ServiceTierLine(LineNumbers, ServiceTierKey):
    pass


_LINE_TYPES: dict[GroupBy, type[LineNumbers]] = {
    GroupBy.TENANT: TenantLine,
    GroupBy.ENDPOINT: EndpointLine,
    GroupBy.MODEL: ModelLine,
    GroupBy.DAY: DayLine,
    GroupBy.SERVICE_TIER: ServiceTierLine,
}


class BillingReportOut(BaseModel):
    """Requests started in [start, end), one row per group, each request rated by the price version in force when
    it started. Money is rounded once per line (docs/decisions/0011-billing-rounding.md): each money column's rows
    add up to its total, and each row's four costs add up to its cost_total."""

    object: Literal["billing.report"] = "billing.report"
    start: datetime
    end: datetime
    group_by: GroupBy
    currency: str
    rows: list[TenantLine] | list[EndpointLine] | list[ModelLine] | list[DayLine] | list[ServiceTierLine]
    totals: LineNumbers

    @classmethod
    def of(cls, report: BillingReport) -> BillingReportOut:
        line_type = _LINE_TYPES[report.group_by]
        names = report.group_by.key_names
        rows = [
            line_type.model_validate({**dict(zip(names, line.key, strict=True)), **LineNumbers.numbers(line)})
            for line in report.lines
        ]
        return cls.model_validate(
            {
                "start": report.start,
                "end": report.end,
                "group_by": report.group_by,
                "currency": report.currency,
                "rows": rows,
                "totals": LineNumbers.model_validate(LineNumbers.numbers(report.totals)),
            }
        )


# A spreadsheet runs a cell that starts with one of these as a formula; endpoint names are chosen by tenants.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: str | None) -> str:
    if value is None:
        return ""
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def report_csv(report: BillingReport) -> str:
    """A header row, one row per group, and a totals row (`total` in the first key column). Quoted as RFC 4180
    needs; text that a spreadsheet would run as a formula gets a leading apostrophe (OWASP's advice)."""
    names = report.group_by.key_names
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    number_names = list(line_fields(report.totals))
    writer.writerow([*names, *number_names])
    for line in report.lines:
        writer.writerow([*(_cell(part) for part in line.key), *_csv_numbers(line)])
    writer.writerow(["total", *([""] * (len(names) - 1)), *_csv_numbers(report.totals)])
    return buffer.getvalue()


def _csv_numbers(line: Line) -> list[str]:
    return [
        str(value) if name == "cache_hit_rate" or not isinstance(value, Decimal) else money(value)
        for name, value in line_fields(line).items()
    ]
