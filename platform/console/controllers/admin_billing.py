"""The admin's billing page: the billing page's report (billing/page.py: the same reports, view model and sections
as /admin/billing) inside the console's frame, a period form, and the report as CSV downloads.

/admin/billing's own links need a bearer token, which a browser signed in to the console does not send, so the CSV
download has its own address here (`/console/admin/billing.csv`), behind the console's session. The report's styles
(billing_page.css, inlined by the standalone page) are served from here as a file: the console's CSP allows no
inline style.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlencode

import anyio
from litestar import Controller, Response, get
from litestar.params import FromQuery
from litestar.response import Template

from loraplex.platform.console.access import Caller
from loraplex.platform.console.pages import page
from loraplex.platform.console.security import PAGE_HEADERS
from loraplex.platform.dependencies import DbSession
from loraplex.platform.domain.billing.controllers import CSV_MEDIA_TYPE, csv_headers
from loraplex.platform.domain.billing.page import STYLESHEET, gather, page_range, page_view
from loraplex.platform.domain.billing.rating import GroupBy
from loraplex.platform.domain.billing.schemas import report_csv
from loraplex.platform.domain.billing.service import BillingService
from loraplex.platform.domain.usage.schemas import parse_instant
from loraplex.platform.errors import ApiError

TITLE = "Billing"
STYLESHEET_PATH = "/console/admin/billing.css"
CSV_PATH = "/console/admin/billing.csv"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True, slots=True)
class Download:
    """A CSV of the shown period, grouped by `group_by`."""

    group_by: str
    href: str


def period(start: str | None, end: str | None, *, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) from the period form: dates are whole UTC days, `end`'s included (the form's "to" day); other
    values as the report reads them (unix seconds, ISO 8601 instants). Defaults and limits are the billing page's."""
    return page_range(_bound(start, "start", 0), _bound(end, "end", 1), now=now)


def _bound(value: str | None, param: str, days_after: int) -> datetime | None:
    if value is None or not value.strip():
        return None
    text = value.strip()
    if _DATE.match(text):
        try:
            day = date.fromisoformat(text)
        except ValueError:
            raise ApiError(400, f"'{param}' is not a date.", code="invalid_request", param=param) from None
        return datetime.combine(day + timedelta(days=days_after), time(), tzinfo=UTC)
    return parse_instant(text, param=param)


def _iso(instant: datetime) -> str:
    return instant.isoformat().replace("+00:00", "Z")


class AdminBillingPages(Controller):
    path = "/"

    @get("/billing")
    async def index(
        self, caller: Caller, db: DbSession, start: FromQuery[str | None] = None, end: FromQuery[str | None] = None
    ) -> Template:
        now = datetime.now(UTC)
        form = {"start": start or "", "end": end or ""}
        try:
            since, until = period(start, end, now=now)
        except ApiError as exc:
            return page(
                "admin_billing.html",
                caller,
                title=TITLE,
                status_code=exc.status_code,
                error=exc.message,
                form=form,
                report=None,
                stylesheet=STYLESHEET_PATH,
            )
        data = await gather(db, start=since, end=until)
        query = {"start": _iso(since), "end": _iso(until)}
        downloads = [
            Download(group.value, f"{CSV_PATH}?{urlencode({**query, 'group_by': group.value})}") for group in GroupBy
        ]
        return page(
            "admin_billing.html",
            caller,
            title=TITLE,
            error=None,
            form={"start": f"{since:%Y-%m-%d}", "end": f"{until - timedelta(microseconds=1):%Y-%m-%d}"},
            report=page_view(data, generated_at=now),
            downloads=downloads,
            stylesheet=STYLESHEET_PATH,
        )

    @get("/billing.csv")
    async def csv(
        self,
        db: DbSession,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        group_by: FromQuery[GroupBy] = GroupBy.TENANT,
    ) -> Response[str]:
        since, until = period(start, end, now=datetime.now(UTC))
        report = await BillingService(db).report(start=since, end=until, group_by=group_by)
        headers = {name: PAGE_HEADERS[name] for name in ("X-Content-Type-Options", "Cache-Control")}
        return Response(report_csv(report), media_type=CSV_MEDIA_TYPE, headers={**csv_headers(report), **headers})

    @get("/billing.css")
    async def stylesheet(self) -> Response[Any]:
        # The billing page's own file (a few kB), not a copy: both pages always have the same styles.
        return Response(
            await anyio.Path(STYLESHEET).read_bytes(),
            media_type="text/css; charset=utf-8",
            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
        )
