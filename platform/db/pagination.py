"""Cursor pagination shared by list endpoints: newest first, `after` names the last id of the previous page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.ext.asyncio import AsyncSession

T = TypeVar("T")

MAX_PAGE_SIZE = 100


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    has_more: bool


async def fetch_page(
    session: AsyncSession,
    model: Any,
    query: Select[Any],
    *,
    limit: int,
    after: object | None,
) -> Page[Any]:
    """Run `query` (already scoped by the caller) ordered by (created_at, id) descending.

    `after` must be an id the same scoped query can see; an unknown cursor yields an empty page, so a cursor from
    another tenant reveals nothing.
    """
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    ordered = query.order_by(model.created_at.desc(), model.id.desc())
    if after is not None:
        cursor = await session.scalar(query.with_only_columns(model.created_at).where(model.id == after))
        if cursor is None:
            return Page(items=[], has_more=False)
        ordered = ordered.where(or_(model.created_at < cursor, and_(model.created_at == cursor, model.id < after)))
    rows = list((await session.scalars(ordered.limit(limit + 1))).all())
    return Page(items=rows[:limit], has_more=len(rows) > limit)
