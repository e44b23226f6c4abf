"""Usage shapes at the edge: `GET /v1/usage` answers `{object: "usage", start, end, totals, data, ...}`."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel

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

    @classmethod
    def of(cls, totals: UsageTotals) -> UsageTotalsOut:
        return cls(
            requests=totals.requests,
            prompt_tokens=totals.prompt_tokens,
            cached_tokens=totals.cached_tokens,
            completion_tokens=totals.completion_tokens,
        )


class UsageRecordOut(BaseModel):
    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str
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
            status=record.status,
            started_at=record.started_at,
            finished_at=record.finished_at,
        )


class UsageOut(BaseModel):
    """The tenant's requests started in [start, end): totals over the whole range, `data` one page of it (newest
    first; pass `last_id` as `after` for the next page)."""

    object: Literal["usage"] = "usage"
    start: datetime
    end: datetime
    totals: UsageTotalsOut
    data: list[UsageRecordOut]
    has_more: bool
    first_id: str | None
    last_id: str | None
