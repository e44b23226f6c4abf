"""The `loraplex` command: help everywhere, migrations, bootstrap admin commands, refusal on an old schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from litestar.testing import TestClient

from loraplex.platform.app import create_app
from loraplex.platform.cli import main
from loraplex.platform.db.migrate import head_revisions
from loraplex.platform.settings import load_settings

COMMANDS = [
    [],
    ["dev"],
    ["platform"],
    ["platform", "serve"],
    ["engine"],
    ["engine", "serve"],
    ["db"],
    ["db", "upgrade"],
    ["admin"],
    ["admin", "create-tenant"],
    ["admin", "create-key"],
]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)
    return {"LORAPLEX_DATA_DIR": str(tmp_path / "data")}


@pytest.mark.unit
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "loraplex")
def test_help(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


@pytest.mark.unit
def test_bootstrap_on_sqlite(env: dict[str, str]) -> None:
    runner = CliRunner(env=env)
    upgraded = runner.invoke(main, ["db", "upgrade"])
    assert upgraded.exit_code == 0, upgraded.output
    assert f"database is at revision {', '.join(sorted(head_revisions()))}" in upgraded.output
    assert runner.invoke(main, ["db", "upgrade"]).exit_code == 0  # again: a no-op

    created = runner.invoke(main, ["admin", "create-tenant", "acme"])
    assert created.exit_code == 0, created.output
    tenant = json.loads(created.output)
    assert tenant["name"] == "acme"
    duplicate = runner.invoke(main, ["admin", "create-tenant", "acme"])
    assert duplicate.exit_code != 0
    assert "already exists" in duplicate.output

    tenant_key = json.loads(runner.invoke(main, ["admin", "create-key", "--tenant", tenant["id"]]).output)["key"]
    admin_key = json.loads(runner.invoke(main, ["admin", "create-key", "--name", "ops"]).output)["key"]
    assert tenant_key.startswith("lpx_")
    assert admin_key.startswith("lpxadm_")

    # The keys work against an app on the same data dir (embedded mode: SQLite, in-process cache, local store).
    settings = load_settings(data_dir=Path(env["LORAPLEX_DATA_DIR"]), engine_mode="off")
    with TestClient(app=create_app(settings)) as client:
        me = client.get("/v1/me", headers={"Authorization": f"Bearer {tenant_key}"})
        assert me.status_code == 200
        assert me.json()["id"] == tenant["id"]
        listed = client.get("/admin/tenants", headers={"Authorization": f"Bearer {admin_key}"})
        assert listed.status_code == 200
        assert [t["name"] for t in listed.json()["data"]] == ["acme"]
        ready = client.get("/readyz")
        assert ready.json()["checks"] == {"database": "ok", "kv (in-process)": "ok", "object_store": "ok"}


@pytest.mark.unit
def test_create_key_for_unknown_tenant(env: dict[str, str]) -> None:
    runner = CliRunner(env=env)
    assert runner.invoke(main, ["db", "upgrade"]).exit_code == 0
    result = runner.invoke(main, ["admin", "create-key", "--tenant", "00000000-0000-0000-0000-000000000000"])
    assert result.exit_code != 0
    assert "No tenant" in result.output


@pytest.mark.unit
def test_serve_refuses_an_unmigrated_database(env: dict[str, str]) -> None:
    result = CliRunner(env=env).invoke(main, ["platform", "serve", "--port", "1"])
    assert result.exit_code != 0
    assert "loraplex db upgrade" in result.output


@pytest.mark.unit
@pytest.mark.parametrize(
    "placeholder",
    [
        {"LORAPLEX_ADMIN_TOKEN": "change-me-admin"},
        {"LORAPLEX_SECRET_KEY": "change-me-dev-secret-key"},
        {"LORAPLEX_ENGINE_API_KEY": "Change-Me-engine-key"},
    ],
    ids=["admin token", "secret key", "engine key"],
)
def test_serve_refuses_compose_placeholders_outside_the_dev_profile(
    env: dict[str, str], placeholder: dict[str, str]
) -> None:
    result = CliRunner(env={**env, **placeholder}).invoke(main, ["platform", "serve", "--port", "1"])
    assert result.exit_code != 0
    assert next(iter(placeholder)) in result.output
    assert "LORAPLEX_PROFILE=dev" in result.output
    # The dev profile lets it through, to the next check (this database is not migrated).
    result = CliRunner(env={**env, **placeholder, "LORAPLEX_PROFILE": "dev"}).invoke(
        main, ["platform", "serve", "--port", "1"]
    )
    assert result.exit_code != 0
    assert "loraplex db upgrade" in result.output


@pytest.mark.unit
def test_engine_serve_refuses_an_empty_api_key(env: dict[str, str], tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    result = CliRunner(env={**env, "LORAPLEX_ENGINE_API_KEY": " "}).invoke(
        main, ["engine", "serve", "--model", str(model)]
    )
    assert result.exit_code != 0
    assert "--api-key" in result.output


@pytest.mark.unit
def test_create_tenant_refuses_an_unmigrated_database(env: dict[str, str]) -> None:
    result = CliRunner(env=env).invoke(main, ["admin", "create-tenant", "x"])
    assert result.exit_code != 0
    assert "loraplex db upgrade" in result.output


@pytest.mark.integration
def test_upgrade_on_postgres(env: dict[str, str], database_url: str) -> None:
    runner = CliRunner(env={**env, "LORAPLEX_DATABASE_URL": database_url, "LORAPLEX_SECRET_KEY": "k" * 32})
    result = runner.invoke(main, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    created = runner.invoke(main, ["admin", "create-tenant", "pg-tenant"])
    assert created.exit_code == 0, created.output


@pytest.mark.unit
def test_shared_database_needs_a_secret_key(env: dict[str, str]) -> None:
    runner = CliRunner(env={**env, "LORAPLEX_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    result = runner.invoke(main, ["admin", "create-tenant", "x"])
    assert result.exit_code != 0
    assert "LORAPLEX_SECRET_KEY" in result.output
