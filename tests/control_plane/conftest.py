"""Fixtures for the control plane: settings on real services, a migrated database, apps and clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine
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


@pytest.fixture
async def app(integration_settings: Settings) -> Litestar:
    await migrate(integration_settings)
    return create_app(integration_settings)


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
