"""Fixtures every test folder shares: real services for integration tests, and the skip for gpu tests.

Servers are session-scoped and start only when a test asks for one (see _support/services.py for where
they come from). Each integration test gets its own database, Redis key prefix and S3 bucket, removed after
it, so tests never see each other's data. Names carry a per-session tag so that sessions sharing one server
(through DATABASE_URL and friends) stay apart too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import pytest
from _support import services
from _support.services import PostgresServer, RedisServer, S3Server

T = TypeVar("T")

# Triton decides when a function is decorated whether to interpret it, so the switch must be set before any
# module that defines kernels is imported (engine code imports them at its top).
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    # Imported here: torch takes seconds to import and most sessions collect no gpu test.
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)


def _start(stack: contextlib.ExitStack, provider: contextlib.AbstractContextManager[T]) -> T:
    try:
        return stack.enter_context(provider)
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def session_tag() -> str:
    """Six hex digits naming this test session in every database, key prefix and bucket it creates."""
    return secrets.token_hex(3)


@pytest.fixture(scope="session")
def docker_probe() -> services.DockerProbe:
    return services.DockerProbe()


@pytest.fixture(scope="session")
def postgres_server(docker_probe: services.DockerProbe) -> Iterator[PostgresServer]:
    with contextlib.ExitStack() as stack:
        yield _start(stack, services.provide_postgres(docker_probe))


@pytest.fixture(scope="session")
def redis_server(docker_probe: services.DockerProbe) -> Iterator[RedisServer]:
    with contextlib.ExitStack() as stack:
        yield _start(stack, services.provide_redis(docker_probe))


@pytest.fixture(scope="session")
def s3_server(docker_probe: services.DockerProbe) -> Iterator[S3Server]:
    with contextlib.ExitStack() as stack:
        yield _start(stack, services.provide_s3(docker_probe))


@pytest.fixture
async def database_url(postgres_server: PostgresServer, session_tag: str) -> AsyncIterator[str]:
    """A new, empty database for this test (postgresql+asyncpg://...), dropped after it."""
    name = f"t_{session_tag}_{secrets.token_hex(4)}"
    await services.create_database(postgres_server.url, name)
    try:
        yield services.database_url_for(postgres_server.url, name)
    finally:
        await services.drop_database(postgres_server.url, name)


@pytest.fixture
async def redis_prefix(redis_server: RedisServer, session_tag: str) -> AsyncIterator[str]:
    """A key prefix ("t<hex>:") owned by this test; every key under it is deleted after the test."""
    prefix = f"t{session_tag}{secrets.token_hex(4)}:"
    try:
        yield prefix
    finally:
        await services.delete_redis_keys(redis_server.url, prefix)


@pytest.fixture
def s3_bucket(s3_server: S3Server, session_tag: str) -> Iterator[str]:
    """A new, empty bucket for this test; its objects, unfinished uploads and the bucket go after it."""
    name = f"t-{session_tag}-{secrets.token_hex(4)}"
    client = services.s3_client(s3_server)
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        services.purge_bucket(client, name)
        client.close()
