"""The async SQLAlchemy engine and session factory for one process."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

# Without timeouts given (migrations, one-off CLI work): SQLite waits this long for a lock, nothing else is bounded.
_DEFAULT_SQLITE_BUSY_S = 30.0


def create_engine(
    url: str,
    *,
    pool_size: int = 10,
    statement_timeout_s: float | None = None,
    pool_timeout_s: float | None = None,
) -> AsyncEngine:
    """Create the engine for `url` (an async-driver URL, see settings.normalize_database_url).

    The timeouts bound a database that is down, frozen or overloaded, so that a request fails in seconds (the app
    answers 503, see errors.py) rather than waiting with its client: `statement_timeout_s` for one statement (in
    the server, and in the client for a server that does not answer at all; SQLite: how long it waits for a lock),
    `pool_timeout_s` for a connection (a free one from the pool, or a new one's connect). The serving path sets
    both (Resources); migrations leave them unset, since a schema change may rightly run long.
    """
    pool: dict[str, Any] = {} if pool_timeout_s is None else {"pool_timeout": pool_timeout_s}
    if url.startswith("sqlite"):
        busy_s = statement_timeout_s or _DEFAULT_SQLITE_BUSY_S
        engine = create_async_engine(url, connect_args={"timeout": busy_s}, **pool)
        event.listen(engine.sync_engine, "connect", lambda connection, _: _sqlite_pragmas(connection, busy_s))
        return engine
    connect: dict[str, Any] = {}
    if pool_timeout_s is not None:
        connect["timeout"] = pool_timeout_s  # asyncpg's connect timeout
    if statement_timeout_s is not None:
        connect["command_timeout"] = statement_timeout_s
        connect["server_settings"] = {"statement_timeout": str(round(statement_timeout_s * 1000))}
    return create_async_engine(
        url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, connect_args=connect, **pool
    )


def _sqlite_pragmas(dbapi_connection: Any, busy_s: float) -> None:
    # SQLite ignores foreign keys unless asked, and WAL lets readers proceed while one writer commits.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={round(busy_s * 1000)}")
    cursor.close()


def create_session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # expire_on_commit=False: attribute reads after a commit would otherwise need IO (MissingGreenlet).
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)
