"""Migrations: head -> base -> head round trips, and the models match the migrated schema exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from litestar.testing import AsyncTestClient
from sqlalchemy import Connection, inspect

from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine
from loraplex.platform.db.migrate import (
    MigrationsNotAtHead,
    current_revisions,
    downgrade,
    head_revisions,
    upgrade,
)
from loraplex.platform.db.models import Base
from loraplex.platform.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


def _tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names()) - {"alembic_version"}


async def _round_trip(url: str) -> None:
    engine = create_engine(url)
    try:
        await upgrade(engine)
        async with engine.connect() as connection:
            assert await connection.run_sync(_diff) == []
            assert await connection.run_sync(_tables) == set(Base.metadata.tables)
        assert await current_revisions(engine) == head_revisions()

        await downgrade(engine, "base")
        async with engine.connect() as connection:
            assert await connection.run_sync(_tables) == set()
        assert await current_revisions(engine) == set()

        await upgrade(engine)
        async with engine.connect() as connection:
            assert await connection.run_sync(_diff) == []
    finally:
        await engine.dispose()


@pytest.mark.integration
async def test_round_trip_on_postgres(database_url: str) -> None:
    await _round_trip(database_url)


@pytest.mark.unit
async def test_round_trip_on_sqlite(tmp_path: Path) -> None:
    await _round_trip(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")


@pytest.mark.unit
def test_revision_files_are_date_prefixed() -> None:
    files = sorted(p.name for p in (REPO / "migrations" / "versions").glob("*.py"))
    assert files
    for name in files:
        assert name[:4].isdigit() and name[4] == "_" and name[7] == "_" and name[10] == "_", name


@pytest.mark.integration
async def test_app_refuses_to_start_before_migrations(integration_settings: Settings) -> None:
    app = create_app(integration_settings)
    # The test client runs the lifespan in a task group, which wraps the error.
    with pytest.raises(ExceptionGroup) as info:
        async with AsyncTestClient(app=app):
            pass
    assert info.group_contains(MigrationsNotAtHead, match="loraplex db upgrade")


@pytest.mark.integration
async def test_app_refuses_to_start_one_migration_behind(integration_settings: Settings, tmp_path: Path) -> None:
    engine = create_engine(integration_settings.effective_database_url)
    try:
        await upgrade(engine)
        await downgrade(engine, "-1")
    finally:
        await engine.dispose()
    with pytest.raises(ExceptionGroup) as info:
        async with AsyncTestClient(app=create_app(integration_settings)):
            pass
    assert info.group_contains(MigrationsNotAtHead, match="loraplex db upgrade")
