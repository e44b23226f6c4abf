"""The `loraplex` command: run the embedded default, serve the platform or an engine, migrate, administer."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import SecretStr

from loraplex.engine.serve import configure_logging
from loraplex.engine.serve import engine as engine_commands
from loraplex.platform.settings import Settings, SettingsError, load_settings, placeholder_secrets

T = TypeVar("T")
logger = logging.getLogger(__name__)


def _settings(**overrides: Any) -> Settings:
    try:
        return load_settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None


def _run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one coroutine, turning the errors a user can fix into a one-line message."""
    from loraplex.platform.db.migrate import MigrationsNotAtHead
    from loraplex.platform.errors import ApiError

    try:
        return asyncio.run(factory())
    except (MigrationsNotAtHead, SettingsError) as exc:
        raise click.ClickException(str(exc)) from None
    except ApiError as exc:
        raise click.ClickException(exc.message) from None


def _ensure_data_dir(settings: Settings) -> None:
    # The embedded SQLite file lives in the data dir; SQLite cannot create the folder itself.
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)


def _serve(settings: Settings) -> None:
    import uvicorn

    from loraplex.platform.app import create_app
    from loraplex.platform.db.engine import create_engine
    from loraplex.platform.db.migrate import ensure_at_head

    async def check() -> None:
        _ensure_data_dir(settings)
        engine = create_engine(settings.effective_database_url)
        try:
            await ensure_at_head(engine)
        finally:
            await engine.dispose()

    # The lifespan checks too; checking here first gives a one-line error instead of a traceback.
    _run(check)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


async def _upgrade(settings: Settings) -> str:
    from loraplex.platform.db.engine import create_engine
    from loraplex.platform.db.migrate import current_revisions, upgrade

    _ensure_data_dir(settings)
    engine = create_engine(settings.effective_database_url)
    try:
        await upgrade(engine)
        return ", ".join(sorted(await current_revisions(engine)))
    finally:
        await engine.dispose()


@click.group()
@click.version_option(package_name="loraplex")
def main() -> None:
    """loraplex: many customers' LoRA fine-tunes served from shared GPUs, with a control plane and billing.

    Settings come from LORAPLEX_* environment variables (see README.md); options below override them.
    """


@main.command()
@click.option("--host", default=None, help="Address to bind (LORAPLEX_HOST; default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind (LORAPLEX_PORT; default 8000).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for SQLite, objects and generated secrets (LORAPLEX_DATA_DIR; default .loraplex).",
)
def dev(host: str | None, port: int | None, data_dir: Path | None) -> None:
    """Run the embedded default: one process with SQLite, a local object store and an in-process engine."""
    from loraplex.platform.resources import read_or_create_secret

    configure_logging()
    settings = _settings(host=host, port=port, data_dir=data_dir)
    if settings.admin_token is None:
        token = read_or_create_secret(settings.data_dir / "admin_token")
        settings = settings.model_copy(update={"admin_token": SecretStr(token)})
    assert settings.admin_token is not None
    revision = _run(lambda: _upgrade(settings))
    url = settings.public_url or f"http://{settings.host}:{settings.port}"
    token = settings.admin_token.get_secret_value()
    click.echo(
        "\n".join(
            [
                "",
                f"loraplex is starting at {url} (data in {settings.data_dir.resolve()}, schema {revision})",
                f"  console: {url}/console  (sign in with the admin token, or a tenant's API key)",
                f"  admin token: {token}",
                "  try:",
                f"    curl -s -X POST {url}/admin/tenants -H 'Authorization: Bearer {token}' "
                "-H 'Content-Type: application/json' -d '{\"name\": \"acme\"}'",
                f"    curl -s {url}/admin/tenants -H 'Authorization: Bearer {token}'",
                f"  API docs: {url}/schema",
                "",
            ]
        )
    )
    _serve(settings)


@main.group()
def platform() -> None:
    """The control plane (stateless; run as many replicas as you like behind a load balancer)."""


@platform.command("serve")
@click.option("--host", default=None, help="Address to bind (LORAPLEX_HOST).")
@click.option("--port", type=int, default=None, help="Port to bind (LORAPLEX_PORT).")
def platform_serve(host: str | None, port: int | None) -> None:
    """Serve the platform API with the configured database, Redis and object store."""
    configure_logging()
    settings = _settings(host=host, port=port)
    if settings.profile != "dev" and (names := placeholder_secrets(settings)):
        raise click.ClickException(
            f"{', '.join(names)} still hold the placeholder of compose.yaml: put real secrets in a .env file beside "
            "it (or the environment), or set LORAPLEX_PROFILE=dev for a throwaway deployment"
        )
    _serve(settings)


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Migrate the configured database to the newest schema (safe to run again)."""
    configure_logging("WARNING")
    settings = _settings()
    revision = _run(lambda: _upgrade(settings))
    click.echo(f"database is at revision {revision}")


@main.group()
def admin() -> None:
    """Administration without the HTTP API (bootstrap, scripts)."""


@admin.command("create-tenant")
@click.argument("name")
def admin_create_tenant(name: str) -> None:
    """Create a tenant and print it as JSON."""
    from loraplex.platform.domain.tenants.schemas import TenantCreate, TenantOut
    from loraplex.platform.domain.tenants.service import TenantService
    from loraplex.platform.resources import Resources

    settings = _settings()
    try:
        valid_name = TenantCreate(name=name).name
    except ValueError as exc:
        raise click.ClickException(f"invalid tenant name: {exc}") from None

    async def create() -> str:
        resources = await Resources.open(settings, with_engines=False)
        try:
            async with resources.sessions() as session:
                tenant = await TenantService(session).create(valid_name)
                await session.commit()
                return TenantOut.of(tenant, settings.default_service_tiers).model_dump_json()
        finally:
            await resources.close()

    click.echo(_run(create))


@admin.command("create-key")
@click.option("--tenant", "tenant_id", type=click.UUID, default=None, help="Create a key for this tenant.")
@click.option("--name", default=None, help="A label for the key.")
def admin_create_key(tenant_id: uuid.UUID | None, name: str | None) -> None:
    """Create an admin key (or, with --tenant, a tenant API key); the key is printed once."""
    from loraplex.platform.domain.api_keys.schemas import ApiKeyCreated
    from loraplex.platform.domain.api_keys.service import ApiKeyService
    from loraplex.platform.ids import TenantId
    from loraplex.platform.resources import Resources

    settings = _settings()

    async def create() -> str:
        resources = await Resources.open(settings, with_engines=False)
        try:
            async with resources.sessions() as session:
                service = ApiKeyService(session, resources.hasher)
                if tenant_id is None:
                    admin_row, new_key = await service.create_admin_key(name=name)
                    created = ApiKeyCreated.created(admin_row, new_key)
                else:
                    row, new_key = await service.create(TenantId(tenant_id), name=name)
                    created = ApiKeyCreated.created(row, new_key)
                await session.commit()
                return json.dumps(created.model_dump(mode="json"))
        finally:
            await resources.close()

    click.echo(_run(create))


# `loraplex engine ...`: the engine's own commands, which need nothing of the platform.
main.add_command(engine_commands)
