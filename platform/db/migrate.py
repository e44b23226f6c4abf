"""Alembic, driven from code: `loraplex db upgrade`, the start-up check and the tests all come through here.

The migration scripts ship inside the package (`loraplex.migrations`), so an installed wheel can migrate too.
"""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

# Date-prefixed revision files sort by creation time in a listing.
FILE_TEMPLATE = "%%(year)d_%%(month).2d_%%(day).2d_%%(hour).2d%%(minute).2d-%%(rev)s_%%(slug)s"
UPGRADE_COMMAND = "loraplex db upgrade"


class MigrationsNotAtHead(RuntimeError):
    """The database schema is not the one this code expects."""


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(files("loraplex.migrations")))
    config.set_main_option("file_template", FILE_TEMPLATE)
    return config


def head_revisions() -> set[str]:
    return set(ScriptDirectory.from_config(alembic_config()).get_heads())


def _run(connection: Connection, action: str, revision: str) -> None:
    config = alembic_config()
    # env.py uses this connection instead of opening its own (and its own event loop).
    config.attributes["connection"] = connection
    if action == "upgrade":
        command.upgrade(config, revision)
    else:
        command.downgrade(config, revision)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    async with engine.begin() as connection:
        await connection.run_sync(_run, "upgrade", revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    async with engine.begin() as connection:
        await connection.run_sync(_run, "downgrade", revision)


def _current(connection: Connection) -> set[str]:
    return set(MigrationContext.configure(connection).get_current_heads())


async def current_revisions(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as connection:
        return await connection.run_sync(_current)


async def ensure_at_head(engine: AsyncEngine) -> None:
    """Raise MigrationsNotAtHead, naming the command that fixes it, unless the schema is at head."""
    current = await current_revisions(engine)
    heads = head_revisions()
    if current != heads:
        shown = ", ".join(sorted(current)) or "empty (no migrations applied)"
        raise MigrationsNotAtHead(
            f"the database schema is at {shown} but this code needs {', '.join(sorted(heads))}: "
            f"run `{UPGRADE_COMMAND}` (with the same LORAPLEX_DATABASE_URL) and start again"
        )
