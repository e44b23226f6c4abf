"""Fixtures for the control plane: settings on real services, a migrated database, apps and clients."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from _support import services
from _support.services import PostgresServer, RedisServer, S3Server
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.settings import Settings

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
SECRET_KEY = "secret-key-for-tests-0123456789abcdef"


@pytest.fixture
def integration_settings(
    tmp_path: Path, database_url: str, redis_server: Any, redis_prefix: str, s3_server: Any, s3_bucket: str
) -> Settings:
    """Settings on real Postgres, Redis and S3, each isolated for this test."""
    return Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        redis_url=redis_server.url,
        redis_prefix=redis_prefix,
        s3_bucket=s3_bucket,
        s3_endpoint_url=s3_server.endpoint_url,
        s3_region=s3_server.region,
        s3_access_key_id=s3_server.access_key_id,
        s3_secret_access_key=s3_server.secret_access_key,
        admin_token=ADMIN_TOKEN,
        secret_key=SECRET_KEY,
        engine_mode="off",
    )


async def migrate(settings: Settings) -> None:
    engine = create_engine(settings.effective_database_url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()


async def _create_module_state(
    data_dir: Path,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
    fields: dict[str, Any],
) -> Settings:
    database = f"t_{session_tag}_{secrets.token_hex(4)}"
    bucket = f"t-{session_tag}-{secrets.token_hex(4)}"
    prefix = f"t{session_tag}{secrets.token_hex(4)}:"
    await services.create_database(postgres_server.url, database)
    with contextlib.closing(services.s3_client(s3_server)) as s3:
        s3.create_bucket(Bucket=bucket)
    value = Settings(
        **{
            "data_dir": data_dir,
            "database_url": services.database_url_for(postgres_server.url, database),
            "redis_url": redis_server.url,
            "redis_prefix": prefix,
            "s3_bucket": bucket,
            "s3_endpoint_url": s3_server.endpoint_url,
            "s3_region": s3_server.region,
            "s3_access_key_id": s3_server.access_key_id,
            "s3_secret_access_key": s3_server.secret_access_key,
            "admin_token": ADMIN_TOKEN,
            "secret_key": SECRET_KEY,
            "engine_mode": "off",
            **fields,
        }
    )
    await migrate(value)
    return value


async def _remove_module_state(
    settings: Settings, postgres_server: PostgresServer, redis_server: RedisServer, s3_server: S3Server
) -> None:
    assert settings.s3_bucket is not None
    with contextlib.closing(services.s3_client(s3_server)) as s3:
        services.purge_bucket(s3, settings.s3_bucket)
    await services.delete_redis_keys(redis_server.url, settings.redis_prefix)
    database = make_url(settings.effective_database_url).database
    assert database is not None
    await services.drop_database(postgres_server.url, database)


@contextlib.asynccontextmanager
async def module_settings(
    data_dir: Path,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
    **fields: Any,
) -> AsyncIterator[Settings]:
    """Settings on a migrated database, a Redis prefix and a bucket of their own (for a module's fixtures), all
    removed afterwards. `fields` are further Settings fields (engine_mode defaults to "off")."""
    value = await _create_module_state(data_dir, postgres_server, redis_server, s3_server, session_tag, fields)
    try:
        yield value
    finally:
        await _remove_module_state(value, postgres_server, redis_server, s3_server)


@contextlib.contextmanager
def module_settings_sync(
    data_dir: Path,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
    **fields: Any,
) -> Iterator[Settings]:
    """`module_settings` for synchronous fixtures (each step on a short-lived event loop of its own)."""
    value = asyncio.run(_create_module_state(data_dir, postgres_server, redis_server, s3_server, session_tag, fields))
    try:
        yield value
    finally:
        asyncio.run(_remove_module_state(value, postgres_server, redis_server, s3_server))


@contextlib.contextmanager
def serving(app: Litestar, *, port: int = 0, start_timeout_s: float = 120) -> Iterator[str]:
    """`app` on a uvicorn server (lifespan included), in a thread with its own event loop, as in production;
    yields its URL. Port 0 takes any free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=5))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="platform-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert not failure, f"the platform failed to start: {failure[0]!r}"
            assert thread.is_alive(), "the platform failed to start (see the log)"
            assert time.monotonic() < deadline, "the platform did not start in time"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{bound}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture
async def app(integration_settings: Settings) -> Litestar:
    await migrate(integration_settings)
    return create_app(integration_settings)


@pytest.fixture
async def sessions(app: Litestar, integration_settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions of the test's own on its database (migrated by the `app` fixture); the app's pool lives on the test
    client's event loop, in another thread."""
    engine = create_engine(integration_settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def client(app: Litestar) -> AsyncIterator[AsyncTestClient[Litestar]]:
    async with AsyncTestClient(app=app) as test_client:
        yield test_client


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def make_tenant(client: AsyncTestClient[Litestar], admin_headers: dict[str, str]) -> Callable[[str], Any]:
    """Create a tenant and one API key for it through the admin API; returns (tenant json, full key)."""

    async def make(name: str) -> tuple[dict[str, Any], str]:
        response = await client.post("/admin/tenants", json={"name": name}, headers=admin_headers)
        assert response.status_code == 201, response.text
        tenant = response.json()
        response = await client.post(
            f"/admin/tenants/{tenant['id']}/api-keys", json={"name": "first"}, headers=admin_headers
        )
        assert response.status_code == 201, response.text
        return tenant, response.json()["key"]

    return make


@pytest.fixture(scope="session")
def tiny_base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama checkpoint (2 layers, hidden 64, GQA) to register as a base model; made once."""
    from _support.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-base"), "llama-gqa")


@pytest.fixture(scope="module")
def demo_settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> Iterator[Settings]:
    """Settings on real services (this module's own database, Redis prefix and bucket) with the embedded engine on
    the demo model (demo/model, served as `loraplex-demo`), as `make dev` runs it."""
    with module_settings_sync(
        tmp_path_factory.mktemp("data"),
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        engine_mode="embedded",
        engine_dtype="float32",
        engine_kv_budget="32MiB",
    ) as value:
        yield value


@pytest.fixture(scope="module")
def demo_platform(demo_settings: Settings) -> Iterator[tuple[Litestar, str]]:
    """The platform with the demo model on a real socket: (app, URL)."""
    import torch

    num_threads = torch.get_num_threads()  # the engine sets it process-wide; give it back to the session after
    app = create_app(demo_settings)
    try:
        with serving(app) as url:
            yield app, url
    finally:
        torch.set_num_threads(num_threads)
