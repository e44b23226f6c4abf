"""Alembic environment. Normally driven by loraplex.platform.db.migrate, which passes an open connection."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from loraplex.platform.db.base import UTCDateTime
from loraplex.platform.db.models import Base

config = context.config
target_metadata = Base.metadata


def _render_item(kind: str, obj: Any, _autogen_context: Any) -> str | bool:
    # Revisions spell plain SQLAlchemy types, so an old revision never breaks when our type helpers change.
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_item=_render_item,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Never queue behind a long transaction holding a lock and block all traffic behind us.
            context.execute("SET LOCAL lock_timeout = '10s'")
        context.run_migrations()


async def _run_with_own_engine(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_configure_and_run)
    finally:
        await engine.dispose()


def run() -> None:
    if context.is_offline_mode():
        context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: use `loraplex db upgrade`, or set sqlalchemy.url")
    asyncio.run(_run_with_own_engine(url))


run()
