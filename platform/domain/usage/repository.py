"""Every query on usage. Writes are idempotent by request id; every read takes the tenant id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, and_, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.pagination import MAX_PAGE_SIZE, Page
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.ids import TenantId


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # part of completion_tokens


class UsageRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def add_if_absent(self, rows: Sequence[dict[str, Any]]) -> int:
        """Insert `rows` (UsageRecord column values), skipping any whose request id is already stored; returns how
        many were inserted. A replay or retry of a request therefore never counts twice.

        One statement whatever the rows (their values bound as parameters, not written into it), so it is compiled
        once per process; the ids it returns are the rows the conflict clause let in."""
        if not rows:
            return 0
        connection = await self._session.connection()
        dialect = connection.dialect.name
        table = cast(Table, UsageRecord.__table__)  # Core, not the ORM's bulk path: the rows are plain values
        if dialect == "postgresql":
            stmt: Any = postgresql.insert(table)
        elif dialect == "sqlite":
            stmt = sqlite.insert(table)
        else:
            raise NotImplementedError(
                f"usage inserts need ON CONFLICT, which loraplex has only for Postgres and SQLite, not {dialect}"
            )
        stmt = stmt.on_conflict_do_nothing(index_elements=[table.c.request_id]).returning(table.c.request_id)
        result = await connection.execute(stmt, list(rows))
        return len(result.all())

    async def get_readable_by_id(self, request_id: str, tenant_id: TenantId) -> UsageRecord | None:
        found: UsageRecord | None = await self._session.scalar(
            select(UsageRecord).where(UsageRecord.request_id == request_id, UsageRecord.tenant_id == tenant_id)
        )
        return found

    async def totals(self, tenant_id: TenantId, *, start: datetime, end: datetime) -> UsageTotals:
        """Sums over the tenant's requests started in [start, end)."""
        row = (
            await self._session.execute(
                select(
                    func.count(),
                    func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
                    func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
                    func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
                    func.coalesce(func.sum(UsageRecord.reasoning_tokens), 0),
                ).where(*self._in_range(tenant_id, start, end))
            )
        ).one()
        return UsageTotals(
            requests=int(row[0]),
            prompt_tokens=int(row[1]),
            cached_tokens=int(row[2]),
            completion_tokens=int(row[3]),
            reasoning_tokens=int(row[4]),
        )

    async def list_in_range(
        self, tenant_id: TenantId, *, start: datetime, end: datetime, limit: int, after: str | None
    ) -> Page[UsageRecord]:
        """The tenant's requests started in [start, end), newest first; `after` is the last request id of the
        previous page. An unknown cursor (or another tenant's) yields an empty page."""
        limit = max(1, min(limit, MAX_PAGE_SIZE))
        query = select(UsageRecord).where(*self._in_range(tenant_id, start, end))
        if after is not None:
            cursor = await self.get_readable_by_id(after, tenant_id)
            if cursor is None:
                return Page(items=[], has_more=False)
            query = query.where(
                or_(
                    UsageRecord.started_at < cursor.started_at,
                    and_(UsageRecord.started_at == cursor.started_at, UsageRecord.request_id < cursor.request_id),
                )
            )
        query = query.order_by(UsageRecord.started_at.desc(), UsageRecord.request_id.desc()).limit(limit + 1)
        rows = list((await self._session.scalars(query)).all())
        return Page(items=rows[:limit], has_more=len(rows) > limit)

    @staticmethod
    def _in_range(tenant_id: TenantId, start: datetime, end: datetime) -> tuple[Any, ...]:
        return (UsageRecord.tenant_id == tenant_id, UsageRecord.started_at >= start, UsageRecord.started_at < end)
