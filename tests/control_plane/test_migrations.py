"""Migrations: head -> base -> head round trips, and the models match the migrated schema exactly."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from litestar.testing import AsyncTestClient
from sqlalchemy import Connection, DateTime, Uuid, bindparam, inspect, text
from sqlalchemy.exc import IntegrityError

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


async def _reasoning_upgrade_keeps_prices_and_usage(url: str) -> None:
    """0008 on a database with data: each price version prices reasoning tokens at its output price (what they cost
    before they had a price of their own), each usage row has none, and going back drops only what 0008 added."""
    engine = create_engine(url)
    try:
        await upgrade(engine, "0007")
        tenant_id, now = uuid.uuid4(), datetime.now(UTC)
        statements = [
            ("INSERT INTO tenants (id, name, status, created_at, updated_at) VALUES (:id, 'acme', 'active', :at, :at)"),
            (
                "INSERT INTO prices (id, base_model, input_per_mtok, cached_input_per_mtok, output_per_mtok, currency, "
                "effective_at, created_at) VALUES (:other, 'm', 1, 0.1, 4.5, 'USD', :at, :at)"
            ),
            (
                "INSERT INTO usage (request_id, tenant_id, model, base_model, prompt_tokens, cached_tokens, "
                "completion_tokens, status, started_at, finished_at) "
                "VALUES ('r1', :id, 'm', 'm', 10, 0, 7, 'ok', :at, :at)"
            ),
            "INSERT INTO base_models (id, name, source, status, created_at) VALUES (:other, 'm', '/m', 'ready', :at)",
        ]
        async with engine.begin() as connection:
            for statement in statements:
                # Typed parameters: SQLite's driver binds neither UUIDs nor aware datetimes by itself.
                bound = text(statement).bindparams(
                    *(bindparam(name, type_=Uuid()) for name in ("id", "other") if f":{name}" in statement),
                    bindparam("at", type_=DateTime(timezone=True)),
                )
                await connection.execute(bound, {"id": tenant_id, "other": uuid.uuid4(), "at": now})
        await upgrade(engine)
        async with engine.connect() as connection:
            price = (await connection.execute(text("SELECT output_per_mtok, reasoning_per_mtok FROM prices"))).one()
            assert Decimal(str(price[1])) == Decimal(str(price[0])) == Decimal("4.5")
            usage = (await connection.execute(text("SELECT completion_tokens, reasoning_tokens FROM usage"))).one()
            assert tuple(usage) == (7, 0)
            model = (await connection.execute(text("SELECT reasoning_config FROM base_models"))).one()
            assert model[0] is None
        await downgrade(engine, "0007")
        async with engine.connect() as connection:
            assert "reasoning_per_mtok" not in await connection.run_sync(_columns, "prices")
            assert "reasoning_tokens" not in await connection.run_sync(_columns, "usage")
            assert "reasoning_config" not in await connection.run_sync(_columns, "base_models")
            assert (await connection.execute(text("SELECT count(*) FROM usage"))).scalar_one() == 1
    finally:
        await engine.dispose()


def _columns(connection: Connection, table: str) -> set[str]:
    return {column["name"] for column in inspect(connection).get_columns(table)}


@pytest.mark.integration
async def test_the_reasoning_migration_on_postgres(database_url: str) -> None:
    await _reasoning_upgrade_keeps_prices_and_usage(database_url)


@pytest.mark.unit
async def test_the_reasoning_migration_on_sqlite(tmp_path: Path) -> None:
    await _reasoning_upgrade_keeps_prices_and_usage(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")


async def _fp8_base_models(url: str) -> None:
    """0009: a base model may be registered as fp8; going back clears that (the old constraint refuses it)."""
    engine = create_engine(url)
    insert = text(
        "INSERT INTO base_models (id, name, source, quantization, status, created_at) "
        "VALUES (:id, :name, '/m', :quantization, 'ready', :at)"
    ).bindparams(bindparam("id", type_=Uuid()), bindparam("at", type_=DateTime(timezone=True)))
    try:
        await upgrade(engine, "0008")
        async with engine.begin() as connection:
            with pytest.raises(IntegrityError):
                async with connection.begin_nested():
                    await connection.execute(
                        insert, {"id": uuid.uuid4(), "name": "early", "quantization": "fp8", "at": datetime.now(UTC)}
                    )
        await upgrade(engine)
        async with engine.begin() as connection:
            for name, quantization in (("m8", "fp8"), ("m4", "int4")):
                values = {"id": uuid.uuid4(), "name": name, "quantization": quantization, "at": datetime.now(UTC)}
                await connection.execute(insert, values)
        await downgrade(engine, "0008")
        async with engine.connect() as connection:
            rows = (await connection.execute(text("SELECT name, quantization FROM base_models ORDER BY name"))).all()
            assert [tuple(row) for row in rows] == [("m4", "int4"), ("m8", None)]
    finally:
        await engine.dispose()


@pytest.mark.integration
async def test_the_fp8_migration_on_postgres(database_url: str) -> None:
    await _fp8_base_models(database_url)


@pytest.mark.unit
async def test_the_fp8_migration_on_sqlite(tmp_path: Path) -> None:
    await _fp8_base_models(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
