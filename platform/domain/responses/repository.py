"""Every query on stored responses, scoped to a tenant (another tenant's id reads as no response)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.domain.responses.models import StoredResponse
from loraplex.platform.ids import TenantId

MAX_CHAIN = 256  # responses a previous_response_id chain may go back through
RUNNING = ("queued", "in_progress")  # a background response's states before it ends


class ResponseRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, tenant_id: TenantId, response_id: str, now: datetime) -> StoredResponse | None:
        row = await self.session.get(StoredResponse, response_id)
        if row is None or row.tenant_id != tenant_id or row.expires_at <= now:
            return None
        return row

    async def chain(self, tenant_id: TenantId, response_id: str, now: datetime) -> list[StoredResponse] | None:
        """The response `response_id` and the ones it continues, oldest first; None when it is not the tenant's (or
        has expired). A response whose predecessor has since expired or been deleted starts the chain."""
        rows: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None and len(rows) < MAX_CHAIN:
            row = await self.get(tenant_id, next_id, now)
            if row is None:
                if not rows:
                    return None
                break
            rows.append(row)
            next_id = row.previous_response_id
        return rows[::-1]

    async def add(self, row: StoredResponse, now: datetime) -> None:
        """Store `row`, and delete every tenant's responses whose retention has ended (a cheap indexed sweep)."""
        await self.session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= now))
        self.session.add(row)

    async def delete(self, tenant_id: TenantId, response_id: str, now: datetime) -> bool:
        row = await self.get(tenant_id, response_id, now)
        if row is None:
            return False
        await self.session.delete(row)
        return True

    async def finish(self, response_id: str, response: dict[str, Any], *, unless_ended: bool = True) -> bool:
        """Write a background response's new state (`response`, its status in it); with `unless_ended`, only while
        it is still queued or in progress (a cancel that came first stays). Whether it was written."""
        query = update(StoredResponse).where(StoredResponse.id == response_id)
        if unless_ended:
            query = query.where(StoredResponse.status.in_(RUNNING))
        result = await self.session.execute(query.values(response=response, status=response["status"]))
        return bool(getattr(result, "rowcount", 0))
