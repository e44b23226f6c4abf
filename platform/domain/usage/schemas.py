"""Usage shapes at the edge: `GET /v1/usage` answers `{object: "usage", start, end, totals, billing, data, ...}`."""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, Field

from loraplex.platform.domain.billing.rating import GroupBy
from loraplex.platform.domain.billing.schemas import (
    BillingReportOut,
    DayLine,
    EndpointLine,
    LineNumbers,
    ModelLine,
    ServiceTierLine,
)
from loraplex.platform.domain.billing.service import BillingReport
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.domain.usage.repository import UsageTotals
from loraplex.platform.errors import invalid_request


def parse_instant(value: str, *, param: str) -> datetime:
    """`value` as a UTC time: unix seconds (`1714521600`, `1714521600.5`) or ISO 8601 (`2024-05-01`,
    `2024-05-01T00:00:00Z`; without an offset it is read as UTC). Raise a 400 naming `param` otherwise."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise invalid_request(f"'{param}' must be a finite time.", param=param)
        try:
            return datetime.fromtimestamp(seconds, tz=UTC)
        except (OverflowError, OSError, ValueError):
            raise invalid_request(f"'{param}' is out of range.", param=param) from None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise invalid_request(
            f"'{param}' must be unix seconds or an ISO 8601 time such as 2024-05-01T00:00:00Z.", param=param
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


class UsageTotalsOut(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = Field(description="The completion tokens spent inside a think block (counted in them).")

    @classmethod
    def of(cls, totals: UsageTotals) -> UsageTotalsOut:
        return cls(
            requests=totals.requests,
            prompt_tokens=totals.prompt_tokens,
            cached_tokens=totals.cached_tokens,
            completion_tokens=totals.completion_tokens,
            reasoning_tokens=totals.reasoning_tokens,
        )


class UsageGroupBy(enum.StrEnum):
    """What a tenant may break its bill down by: the admin report's groupings that stay within one tenant."""

    ENDPOINT = "endpoint"
    MODEL = "model"
    DAY = "day"
    SERVICE_TIER = "service_tier"

    @property
    def billing(self) -> GroupBy:
        return GroupBy(self.value)


class _BillingHead(BaseModel):
    currency: str
    group_by: UsageGroupBy | None = Field(description="What `rows` are grouped by; null when no rows were asked for.")


# The head first, then the numbers, then the rows (pydantic orders fields from the last base class to the first).
class UsageBillingOut(LineNumbers, _BillingHead):
    """What the requests of [start, end) cost: the admin billing report restricted to this tenant, with the same
    rating and rounding (docs/decisions/0011-billing-rounding.md) and money as decimal strings. The numbers are
    that report's totals; `rows` (with `?group_by=`) its lines, which add up to them."""

    rows: list[EndpointLine] | list[ModelLine] | list[DayLine] | list[ServiceTierLine] | None = None

    @classmethod
    def of(cls, report: BillingReport, group_by: UsageGroupBy | None) -> UsageBillingOut:
        # Shaped by the admin report's own code, so the two can never disagree on a number's form.
        shaped = BillingReportOut.of(report)
        return cls.model_validate(
            {
                "currency": report.currency,
                "group_by": group_by,
                **shaped.totals.model_dump(),
                "rows": None if group_by is None else shaped.rows,
            }
        )


class UsageRecordOut(BaseModel):
    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = Field(description="The completion tokens spent inside a think block (counted in them).")
    status: str
    service_tier: str = Field(description="The service tier the request ran on (and is priced at).")
    started_at: datetime
    finished_at: datetime

    @classmethod
    def of(cls, record: UsageRecord) -> UsageRecordOut:
        return cls(
            request_id=record.request_id,
            model=record.model,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            reasoning_tokens=record.reasoning_tokens,
            status=record.status,
            service_tier=record.service_tier,
            started_at=record.started_at,
            finished_at=record.finished_at,
        )


class UsageOut(BaseModel):
    """The tenant's requests started in [start, end): totals and `billing` over the whole range, `data` one page of
    it (newest first; pass `last_id` as `after` for the next page)."""

    object: Literal["usage"] = "usage"
    start: datetime
    end: datetime
    totals: UsageTotalsOut
    billing: UsageBillingOut
    data: list[UsageRecordOut]
    has_more: bool
    first_id: str | None
    last_id: str | None
