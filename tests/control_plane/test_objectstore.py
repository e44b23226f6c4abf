"""Object store: key validation, the local folder store, and the S3 store against a real S3 server."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _support.services import S3Server, s3_client

from loraplex.platform.objectstore import (
    InvalidObjectKey,
    LocalObjectStore,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    S3Config,
    S3ObjectStore,
    create_s3_client,
    open_object_store,
    validate_key,
    validate_prefix,
)
from loraplex.platform.settings import Settings

MiB = 1024 * 1024

NASTY_KEYS = [
    "",
    "../x",
    "a/../b",
    "a/..",
    "..",
    ".",
    "/abs",
    "a\\b",
    "..\\x",
    "a//b",
    "a/",
    "a/./b",
    "./a",
    "x\x00y",
    "x\ny",
    "x\ty",
    "x\x7fy",
    "x\x85y",
    "x" * 1025,
    "é" * 513,  # 513 characters, 1026 UTF-8 bytes
    "bad\ud800surrogate",
]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tree(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


# --- validate_key ------------------------------------------------------------------------------------------


@pytest.mark.unit
class TestValidateKey:
    @pytest.mark.parametrize("key", NASTY_KEYS, ids=repr)
    def test_refuses(self, key: str) -> None:
        with pytest.raises(InvalidObjectKey):
            validate_key(key)

    @pytest.mark.parametrize(
        "key",
        [
            "a",
            "tenants/0b7e/adapters/9f1c/adapter_model.safetensors",
            ".hidden/x",
            "a..b/c...d",
            "ünïcode/ключ/名前",
            "x" * 1024,
            "with space/and-dash_and.dot",
        ],
    )
    def test_accepts(self, key: str) -> None:
        assert validate_key(key) == key

    def test_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match=r"'\.\.'"):
            validate_key("a/../b")

    @pytest.mark.parametrize("prefix", ["", "a", "a/", "tenants/1/adap"])
    def test_prefix_accepts(self, prefix: str) -> None:
        assert validate_prefix(prefix) == prefix

    @pytest.mark.parametrize("prefix", ["/", "../", "a//", "/a", "a/../", "x\x00"])
    def test_prefix_refuses(self, prefix: str) -> None:
        with pytest.raises(InvalidObjectKey):
            validate_prefix(prefix)

    def test_not_found_is_a_key_error_with_a_readable_message(self) -> None:
        error = ObjectNotFound("a/b")
        assert isinstance(error, KeyError)
        assert isinstance(error, ObjectStoreError)
        assert str(error) == "no object with key 'a/b'"


# --- LocalObjectStore --------------------------------------------------------------------------------------


@pytest.mark.unit
class TestLocalObjectStore:
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalObjectStore:
        return LocalObjectStore(tmp_path / "objects")

    async def test_round_trip(self, store: LocalObjectStore) -> None:
        info = await store.put("tenants/t1/adapters/a1/adapter_config.json", b'{"r": 8}')
        assert info == ObjectInfo("tenants/t1/adapters/a1/adapter_config.json", 8, sha256(b'{"r": 8}'))
        assert await store.get("tenants/t1/adapters/a1/adapter_config.json") == b'{"r": 8}'
        assert await store.exists("tenants/t1/adapters/a1/adapter_config.json")
        assert not await store.exists("tenants/t1/adapters/a1/missing")
        await store.delete("tenants/t1/adapters/a1/adapter_config.json")
        assert not await store.exists("tenants/t1/adapters/a1/adapter_config.json")
        await store.delete("tenants/t1/adapters/a1/adapter_config.json")  # idempotent

    async def test_overwrite_replaces(self, store: LocalObjectStore) -> None:
        await store.put("k", b"old content that is longer")
        await store.put("k", b"new")
        assert await store.get("k") == b"new"

    async def test_empty_object(self, store: LocalObjectStore) -> None:
        assert await store.put("empty", b"") == ObjectInfo("empty", 0, sha256(b""))
        assert await store.get("empty") == b""

    async def test_missing_key_raises_not_found(self, store: LocalObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.get("nope")
        await store.put("folder/file", b"x")
        with pytest.raises(ObjectNotFound):
            await store.get("folder")  # a folder of objects is not an object
        with pytest.raises(ObjectNotFound):
            await store.get("folder/file/deeper")

    async def test_list_is_a_sorted_string_prefix_match(self, store: LocalObjectStore) -> None:
        assert await store.list() == []
        for key in ["a/b/2", "a/b/1", "a/bc", "a/c/1", "b"]:
            await store.put(key, key.encode())
        assert await store.list() == ["a/b/1", "a/b/2", "a/bc", "a/c/1", "b"]
        assert await store.list("a/b") == ["a/b/1", "a/b/2", "a/bc"]
        assert await store.list("a/b/") == ["a/b/1", "a/b/2"]
        assert await store.list("a/c/1") == ["a/c/1"]
        assert await store.list("zzz/") == []

    async def test_put_file_streams_and_hashes(self, store: LocalObjectStore, tmp_path: Path) -> None:
        data = os.urandom(3 * MiB + 17)
        source = tmp_path / "source.bin"
        source.write_bytes(data)
        info = await store.put_file("big/model.safetensors", source)
        assert info == ObjectInfo("big/model.safetensors", len(data), sha256(data))
        assert await store.get("big/model.safetensors") == data

    @pytest.mark.parametrize("key", NASTY_KEYS, ids=repr)
    async def test_every_method_refuses_nasty_keys(self, store: LocalObjectStore, tmp_path: Path, key: str) -> None:
        source = tmp_path / "source.bin"
        source.write_bytes(b"x")
        with pytest.raises(InvalidObjectKey):
            await store.put(key, b"x")
        with pytest.raises(InvalidObjectKey):
            await store.put_file(key, source)
        with pytest.raises(InvalidObjectKey):
            await store.get(key)
        with pytest.raises(InvalidObjectKey):
            await store.exists(key)
        with pytest.raises(InvalidObjectKey):
            await store.delete(key)

    async def test_dotdot_writes_nothing_outside_root(self, store: LocalObjectStore, tmp_path: Path) -> None:
        before = _tree(tmp_path)
        for key in ["../escape", "a/../../escape", "../objects-sibling/x"]:
            with pytest.raises(InvalidObjectKey):
                await store.put(key, b"owned")
        with pytest.raises(InvalidObjectKey):
            await store.list("../")
        assert _tree(tmp_path) == before

    async def test_symlink_out_of_root_is_refused(self, store: LocalObjectStore, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret").write_bytes(b"secret")
        store.root.mkdir(parents=True)
        (store.root / "link").symlink_to(outside, target_is_directory=True)
        with pytest.raises(InvalidObjectKey, match="outside"):
            await store.get("link/secret")
        with pytest.raises(InvalidObjectKey, match="outside"):
            await store.put("link/planted", b"x")
        assert sorted(path.name for path in outside.iterdir()) == ["secret"]

    async def test_failed_write_keeps_the_old_object_and_no_temp_file(
        self, store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await store.put("dir/k", b"old")

        def fail_fsync(fd: int) -> None:
            raise OSError("disk on fire")

        # fsync runs after the bytes are written and before the rename: the worst moment to fail.
        monkeypatch.setattr(os, "fsync", fail_fsync)
        with pytest.raises(OSError, match="disk on fire"):
            await store.put("dir/k", b"new content")
        with pytest.raises(OSError, match="disk on fire"):
            await store.put("dir/other", b"new content")
        monkeypatch.undo()
        assert await store.get("dir/k") == b"old"
        assert sorted(path.name for path in (store.root / "dir").iterdir()) == ["k"]
        assert await store.list() == ["dir/k"]

    async def test_missing_source_file_keeps_the_old_object(self, store: LocalObjectStore, tmp_path: Path) -> None:
        await store.put("k", b"old")
        with pytest.raises(FileNotFoundError):
            await store.put_file("k", tmp_path / "does-not-exist")
        assert await store.get("k") == b"old"
        assert sorted(path.name for path in store.root.iterdir()) == ["k"]

    async def test_object_and_folder_cannot_share_a_key(self, store: LocalObjectStore) -> None:
        await store.put("a", b"file")
        with pytest.raises(ObjectStoreError, match="under another object"):
            await store.put("a/b", b"x")
        await store.delete("a")
        await store.put("a/b", b"x")
        with pytest.raises(ObjectStoreError, match="folder of other objects"):
            await store.put("a", b"file")
        # Deleting the last object of a folder prunes the folder, so the key is free again.
        await store.delete("a/b")
        await store.put("a", b"file again")
        assert await store.list() == ["a"]

    async def test_temp_files_are_never_listed_or_addressable(self, store: LocalObjectStore) -> None:
        await store.put("k", b"x")
        (store.root / ".lpx-partial-leftover").write_bytes(b"half")
        assert await store.list() == ["k"]
        with pytest.raises(InvalidObjectKey, match="reserved"):
            await store.get(".lpx-partial-leftover")

    async def test_check_creates_the_root(self, store: LocalObjectStore) -> None:
        assert not store.root.exists()
        await store.check()
        assert store.root.is_dir()

    async def test_check_fails_when_root_is_unusable(self, tmp_path: Path) -> None:
        blocker = tmp_path / "a-file"
        blocker.write_bytes(b"")
        with pytest.raises(ObjectStoreError, match="not writable"):
            await LocalObjectStore(blocker / "objects").check()


# --- choosing a store, S3 configuration --------------------------------------------------------------------


@pytest.mark.unit
class TestOpenObjectStore:
    def test_local_without_a_bucket(self, tmp_path: Path) -> None:
        store = open_object_store(Settings(data_dir=tmp_path))
        assert isinstance(store, LocalObjectStore)
        assert store.root == tmp_path / "objects"

    async def test_s3_with_a_bucket(self, tmp_path: Path) -> None:
        settings = Settings(
            data_dir=tmp_path,
            s3_bucket="artifacts",
            s3_endpoint_url="http://127.0.0.1:1",
            s3_access_key_id="id",
            s3_secret_access_key="secret",
            s3_multipart_threshold=32 * MiB,
            s3_multipart_part_size=8 * MiB,
        )
        store = open_object_store(settings)
        assert isinstance(store, S3ObjectStore)
        assert store.config == S3Config(
            bucket="artifacts",
            endpoint_url="http://127.0.0.1:1",
            access_key_id="id",
            secret_access_key="secret",
            multipart_threshold=32 * MiB,
            multipart_part_size=8 * MiB,
        )
        assert "secret" not in repr(store.config)
        await store.close()

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"bucket": ""}, "bucket"),
            ({"multipart_part_size": 4 * MiB}, "multipart_part_size"),
            ({"multipart_threshold": 5 * MiB, "multipart_part_size": 6 * MiB}, "multipart_threshold"),
            ({"access_key_id": "only-the-id"}, "both"),
            ({"read_timeout_s": 0}, "timeouts"),
        ],
    )
    def test_config_is_validated(self, changes: dict[str, Any], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            S3Config(**{"bucket": "b", **changes})

    async def test_bad_keys_never_reach_the_network(self) -> None:
        # Nothing listens on port 1: a request that got out would fail with a connection error instead.
        config = S3Config(bucket="b", endpoint_url="http://127.0.0.1:1", access_key_id="i", secret_access_key="s")
        sent = await _refuse_bad_keys_everywhere(config)
        assert sent == []


async def _refuse_bad_keys_everywhere(config: S3Config) -> list[str]:
    """Call every keyed method with `../` keys; return the requests that went out."""
    client = create_s3_client(config)
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    store = S3ObjectStore(config, client=client)
    try:
        for key in ["../x", "a/../../b", "/etc/passwd", "a\\..\\b"]:
            with pytest.raises(InvalidObjectKey):
                await store.put(key, b"x")
            with pytest.raises(InvalidObjectKey):
                await store.put(key, b"x" * (5 * MiB))
            with pytest.raises(InvalidObjectKey):
                await store.put_file(key, Path("/dev/null"))
            with pytest.raises(InvalidObjectKey):
                await store.get(key)
            with pytest.raises(InvalidObjectKey):
                await store.exists(key)
            with pytest.raises(InvalidObjectKey):
                await store.delete(key)
        with pytest.raises(InvalidObjectKey):
            await store.list("../")
    finally:
        await store.close()
    return sent


# --- S3ObjectStore on a real server ------------------------------------------------------------------------


def _s3_config(server: S3Server, bucket: str) -> S3Config:
    return S3Config(
        bucket=bucket,
        endpoint_url=server.endpoint_url,
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        multipart_threshold=5 * MiB,
        multipart_part_size=5 * MiB,
        max_attempts=2,
    )


@pytest.mark.integration
class TestS3ObjectStore:
    @pytest.fixture
    def config(self, s3_server: S3Server, s3_bucket: str) -> S3Config:
        return _s3_config(s3_server, s3_bucket)

    @pytest.fixture
    async def store(self, config: S3Config) -> AsyncIterator[S3ObjectStore]:
        store = S3ObjectStore(config)
        yield store
        await store.close()

    async def test_round_trip(self, store: S3ObjectStore, s3_server: S3Server, s3_bucket: str) -> None:
        key = "tenants/t1/adapters/a1/adapter_config.json"
        info = await store.put(key, b'{"r": 8}', content_type="application/json")
        assert info == ObjectInfo(key, 8, sha256(b'{"r": 8}'))
        assert await store.get(key) == b'{"r": 8}'
        assert await store.exists(key)
        head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=key)
        assert head["ContentType"] == "application/json"
        await store.put(key, b"replaced")
        assert await store.get(key) == b"replaced"
        await store.delete(key)
        assert not await store.exists(key)
        await store.delete(key)  # idempotent

    async def test_missing_key_raises_not_found(self, store: S3ObjectStore) -> None:
        with pytest.raises(ObjectNotFound) as caught:
            await store.get("tenants/t1/nope")
        assert caught.value.key == "tenants/t1/nope"
        assert not await store.exists("tenants/t1/nope")

    async def test_list_is_a_sorted_string_prefix_match(self, store: S3ObjectStore) -> None:
        assert await store.list() == []
        for key in ["a/b/2", "a/b/1", "a/bc", "a/c/1", "b"]:
            await store.put(key, key.encode())
        assert await store.list() == ["a/b/1", "a/b/2", "a/bc", "a/c/1", "b"]
        assert await store.list("a/b") == ["a/b/1", "a/b/2", "a/bc"]
        assert await store.list("a/b/") == ["a/b/1", "a/b/2"]
        await store.delete("a/b/1")
        await store.delete("a/b/2")
        assert await store.list("a/") == ["a/bc", "a/c/1"]

    async def test_large_object_goes_up_in_parts(
        self, store: S3ObjectStore, s3_server: S3Server, s3_bucket: str
    ) -> None:
        data = os.urandom(12 * MiB + 123)
        info = await store.put("big/model.safetensors", data)
        assert info == ObjectInfo("big/model.safetensors", len(data), sha256(data))
        assert await store.get("big/model.safetensors") == data
        # A multipart object's ETag is md5-of-part-md5s with "-<number of parts>": 5 + 5 + 2.x MiB = 3 parts.
        client = s3_client(s3_server)
        assert client.head_object(Bucket=s3_bucket, Key="big/model.safetensors")["ETag"].strip('"').endswith("-3")
        small = await store.put("small", b"x" * (5 * MiB - 1))
        assert small.size == 5 * MiB - 1
        assert "-" not in client.head_object(Bucket=s3_bucket, Key="small")["ETag"]

    async def test_large_file_goes_up_in_parts(
        self, store: S3ObjectStore, s3_server: S3Server, s3_bucket: str, tmp_path: Path
    ) -> None:
        data = os.urandom(11 * MiB)
        source = tmp_path / "adapter_model.safetensors"
        source.write_bytes(data)
        info = await store.put_file("big/file", source)
        assert info == ObjectInfo("big/file", len(data), sha256(data))
        assert await store.get("big/file") == data
        head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key="big/file")
        assert head["ETag"].strip('"').endswith("-3")
        small = tmp_path / "small.json"
        small.write_bytes(b"{}")
        assert await store.put_file("small.json", small) == ObjectInfo("small.json", 2, sha256(b"{}"))
        assert await store.get("small.json") == b"{}"

    async def test_failed_multipart_upload_leaves_nothing(
        self, config: S3Config, s3_server: S3Server, s3_bucket: str
    ) -> None:
        client = create_s3_client(config)
        parts_tried: list[int] = []

        def fail_second_part(params: dict[str, Any], **_: Any) -> None:
            parts_tried.append(params["PartNumber"])
            if params["PartNumber"] == 2:
                raise ConnectionError("network cable unplugged")

        client.meta.events.register("provide-client-params.s3.UploadPart", fail_second_part)
        store = S3ObjectStore(config, client=client)
        try:
            await store.put("k", b"old")
            with pytest.raises(ConnectionError):
                await store.put("k", os.urandom(12 * MiB))
            assert parts_tried == [1, 2]
            assert await store.get("k") == b"old"
            with pytest.raises(ConnectionError):
                await store.put("fresh", os.urandom(12 * MiB))
            assert not await store.exists("fresh")
            assert await store.list() == ["k"]
        finally:
            await store.close()
        pending = s3_client(s3_server).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        assert pending == []

    async def test_cancelled_multipart_upload_leaves_nothing(
        self, config: S3Config, s3_server: S3Server, s3_bucket: str
    ) -> None:
        client = create_s3_client(config)
        in_second_part = threading.Event()

        def slow_second_part(params: dict[str, Any], **_: Any) -> None:
            if params["PartNumber"] == 2:
                in_second_part.set()
                time.sleep(0.3)  # still uploading when the cancellation arrives

        client.meta.events.register("provide-client-params.s3.UploadPart", slow_second_part)
        store = S3ObjectStore(config, client=client)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(store.put, "k", os.urandom(12 * MiB))
                assert await anyio.to_thread.run_sync(in_second_part.wait, 30)
                group.cancel_scope.cancel()
            assert not await store.exists("k")
        finally:
            await store.close()
        pending = s3_client(s3_server).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        assert pending == []

    async def test_bad_keys_never_reach_the_network(self, config: S3Config) -> None:
        assert await _refuse_bad_keys_everywhere(config) == []

    async def test_check(self, store: S3ObjectStore, config: S3Config, s3_server: S3Server) -> None:
        await store.check()
        missing = S3ObjectStore(_s3_config(s3_server, "no-such-bucket-for-loraplex"))
        try:
            with pytest.raises(ObjectStoreError, match="no-such-bucket-for-loraplex"):
                await missing.check()
        finally:
            await missing.close()

    async def test_wrong_credentials_fail_clearly(self, config: S3Config) -> None:
        wrong = S3ObjectStore(
            S3Config(
                bucket=config.bucket,
                endpoint_url=config.endpoint_url,
                access_key_id="not-a-key",
                secret_access_key="not-a-secret",
                max_attempts=1,
            )
        )
        try:
            with pytest.raises(ObjectStoreError) as caught:
                await wrong.put("k", b"x")
            assert not isinstance(caught.value, ObjectNotFound)
        finally:
            await wrong.close()

    async def test_open_object_store_from_settings(self, tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
        settings = Settings(
            data_dir=tmp_path,
            s3_bucket=s3_bucket,
            s3_endpoint_url=s3_server.endpoint_url,
            s3_region=s3_server.region,
            s3_access_key_id=s3_server.access_key_id,
            s3_secret_access_key=s3_server.secret_access_key,
        )
        store: ObjectStore = open_object_store(settings)
        try:
            await store.check()
            await store.put("via/settings", b"ok")
            assert await store.get("via/settings") == b"ok"
        finally:
            await store.close()
