"""Object storage for adapter artifacts: an S3 bucket (shared by every replica) or a local folder (embedded mode).

Keys are "/"-separated relative paths, e.g. `tenants/{tenant_id}/adapters/{adapter_id}/adapter_model.safetensors`.
Every method validates its key (or prefix) before touching a file or the network. Writes are all-or-nothing: a
failed put leaves no partial object behind, and on S3 no unfinished multipart upload either. Blocking work (file
I/O, boto3 calls, hashing) runs in worker threads so the event loop keeps serving.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

    from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024  # S3's limit, applied to the local store too so both accept the same keys
MiB = 1024 * 1024
# S3's multipart limits: every part but the last is 5 MiB .. 5 GiB, and an upload has at most 10,000 parts.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024 * MiB
MAX_PARTS = 10_000
_COPY_CHUNK_BYTES = 1 * MiB
# Names of in-progress temporary files in the local store; keys with a segment starting with it are refused there.
_LOCAL_TMP_PREFIX = ".lpx-partial-"
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


class ObjectStoreError(Exception):
    """The object store refused or failed an operation."""


class ObjectNotFound(ObjectStoreError, KeyError):
    """No object has this key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        # KeyError's own __str__ shows repr(args[0]) only; say what is missing.
        return f"no object with key {_show(self.key)}"


class InvalidObjectKey(ObjectStoreError, ValueError):
    """The key (or list prefix) is not a safe relative path; nothing was read or written."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a put stored: the key, its size in bytes and the SHA-256 of its content (hex)."""

    key: str
    size: int
    sha256: str


class ObjectStore(Protocol):
    """Bytes under keys. Implementations: LocalObjectStore, S3ObjectStore; `open_object_store` picks one."""

    async def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        """Store `data` under `key`, replacing any object there; readers see the old or the new, never a part."""
        ...

    async def put_file(self, key: str, path: Path, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        """Store the file at `path` under `key`, streaming it (large files go up in parts on S3)."""
        ...

    async def get(self, key: str) -> bytes:
        """The object's content; raise ObjectNotFound when there is none."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""
        ...

    async def exists(self, key: str) -> bool: ...

    async def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key starting with `prefix` (plain string prefix, "" for all), sorted."""
        ...

    async def check(self) -> None:
        """Readiness: raise ObjectStoreError when the store cannot be used."""
        ...

    async def close(self) -> None: ...


def validate_key(key: str) -> str:
    """Return `key` if it is a safe object key, else raise InvalidObjectKey.

    A key is 1..1024 UTF-8 bytes of "/"-separated segments; no segment is empty (no leading, trailing or double
    "/"), "." or ".."; no backslash and no control character anywhere. The same rules hold for both stores, so
    a key that works locally works on S3 and can never name a file outside the local store's root.
    """
    if not isinstance(key, str):
        raise InvalidObjectKey(f"an object key must be a string, not {type(key).__name__}")
    if not key:
        raise InvalidObjectKey("an object key must not be empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidObjectKey(f"object key {_show(key)} is not valid UTF-8") from None
    if size > MAX_KEY_BYTES:
        raise InvalidObjectKey(f"object key is {size} bytes long; at most {MAX_KEY_BYTES} are allowed")
    if key.startswith("/"):
        raise InvalidObjectKey(f"object key {_show(key)} must be relative (no leading '/')")
    if "\\" in key:
        raise InvalidObjectKey(f"object key {_show(key)} must not contain a backslash")
    if any(_is_control(char) for char in key):
        raise InvalidObjectKey(f"object key {_show(key)} must not contain control characters")
    for segment in key.split("/"):
        if segment == "":
            raise InvalidObjectKey(f"object key {_show(key)} has an empty path segment")
        if segment in (".", ".."):
            raise InvalidObjectKey(f"object key {_show(key)} must not contain '.' or '..' segments")
    return key


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it can start a valid key ("" and a trailing "/" allowed), else raise InvalidObjectKey."""
    if not isinstance(prefix, str):
        raise InvalidObjectKey(f"a key prefix must be a string, not {type(prefix).__name__}")
    if prefix:
        validate_key(prefix.removesuffix("/"))
    return prefix


def _is_control(char: str) -> bool:
    code = ord(char)
    return code < 0x20 or 0x7F <= code <= 0x9F


def _show(key: str) -> str:
    # Keys can be a megabyte of hostile text; error messages and logs get the start of it.
    return repr(key) if len(key) <= 80 else repr(key[:80]) + "..."


# --- local folder --------------------------------------------------------------------------------------------


class LocalObjectStore:
    """ObjectStore in a local folder, for the embedded single-machine mode.

    Key `a/b/c` is the file `root/a/b/c`. A put writes a temporary file in the target's folder, fsyncs it and
    renames it over the target (atomic on POSIX), so a crash leaves the old object or the new one. Unlike S3, a
    key cannot be both an object and a folder of objects (`a` and `a/b`); such a put raises ObjectStoreError.
    `content_type` is not kept. Every path is resolved and must stay inside root, even through symlinks.
    """

    def __init__(self, root: Path) -> None:
        self._root = root

    @property
    def root(self) -> Path:
        return self._root

    async def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        self._check_key(key)

        def write(out: IO[bytes]) -> tuple[int, str]:
            out.write(data)
            return len(data), hashlib.sha256(data).hexdigest()

        return await anyio.to_thread.run_sync(self._write, key, write)

    async def put_file(self, key: str, path: Path, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        self._check_key(key)

        def copy(out: IO[bytes]) -> tuple[int, str]:
            digest, size = hashlib.sha256(), 0
            with path.open("rb") as source:
                while chunk := source.read(_COPY_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            return size, digest.hexdigest()

        return await anyio.to_thread.run_sync(self._write, key, copy)

    async def get(self, key: str) -> bytes:
        self._check_key(key)
        return await anyio.to_thread.run_sync(self._read, key)

    async def delete(self, key: str) -> None:
        self._check_key(key)
        await anyio.to_thread.run_sync(self._delete, key)

    async def exists(self, key: str) -> bool:
        self._check_key(key)
        return await anyio.to_thread.run_sync(lambda: self._path(key).is_file())

    async def list(self, prefix: str = "") -> builtins.list[str]:
        validate_prefix(prefix)
        return await anyio.to_thread.run_sync(self._list, prefix)

    async def check(self) -> None:
        await anyio.to_thread.run_sync(self._check_writable)

    async def close(self) -> None:
        return None

    # Everything below blocks: it runs in worker threads.

    @staticmethod
    def _check_key(key: str) -> None:
        validate_key(key)
        if any(segment.startswith(_LOCAL_TMP_PREFIX) for segment in key.split("/")):
            raise InvalidObjectKey(f"object key {_show(key)}: segments starting {_LOCAL_TMP_PREFIX!r} are reserved")

    def _path(self, key: str) -> Path:
        # Defense in depth: validate_key already refuses "..", but a symlink inside root could still lead out.
        root = self._root.resolve()
        path = (root / key).resolve()
        if path == root or not path.is_relative_to(root):
            raise InvalidObjectKey(f"object key {_show(key)} resolves outside the store")
        return path

    def _write(self, key: str, fill: Callable[[IO[bytes]], tuple[int, str]]) -> ObjectInfo:
        path = self._path(key)
        fd, temp_name = self._create_temp(key, path.parent)
        temp = Path(temp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                size, sha256 = fill(out)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(temp, 0o644)
            os.replace(temp, path)
        except IsADirectoryError:
            temp.unlink(missing_ok=True)
            raise ObjectStoreError(f"object key {_show(key)} is a folder of other objects in the local store") from None
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        logger.debug("stored %s (%d bytes) in %s", _show(key), size, self._root)
        return ObjectInfo(key=key, size=size, sha256=sha256)

    def _create_temp(self, key: str, folder: Path) -> tuple[int, str]:
        # A concurrent delete prunes empty folders, and may do so between our mkdir and mkstemp: try once more.
        for attempt in range(2):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                return tempfile.mkstemp(prefix=_LOCAL_TMP_PREFIX, dir=folder)
            except (FileExistsError, NotADirectoryError):
                raise ObjectStoreError(
                    f"object key {_show(key)} lies under another object in the local store"
                ) from None
            except FileNotFoundError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return  # a folder of other objects, not an object: nothing to delete
        root = self._root.resolve()
        # Prune folders the delete left empty, so `a` can become an object again once `a/b` is gone.
        for parent in path.parents:
            if parent == root or not parent.is_relative_to(root):
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def _list(self, prefix: str) -> builtins.list[str]:
        root = self._root.resolve()
        # Walk only the folder the prefix's complete segments name, not the whole store.
        start = (root / prefix.rpartition("/")[0]).resolve()
        if not start.is_relative_to(root) or not start.is_dir():
            return []
        keys: builtins.list[str] = []
        for folder, _dirs, files in os.walk(start):
            base = Path(folder).relative_to(root)
            for name in files:
                if name.startswith(_LOCAL_TMP_PREFIX) or os.path.islink(os.path.join(folder, name)):
                    continue
                key = (base / name).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def _check_writable(self) -> None:
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(prefix=_LOCAL_TMP_PREFIX, dir=self._root):
                pass
        except OSError as exc:
            raise ObjectStoreError(f"local object store {self._root} is not writable: {exc}") from exc


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse fsync on a directory, which is fine to ignore.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- S3 ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class S3Config:
    """Where and how to reach the bucket. Credentials None: boto3's default chain (env, profile, instance role)."""

    bucket: str
    endpoint_url: str | None = None  # MinIO, SeaweedFS, ...; None: AWS's endpoint for the region
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    multipart_threshold: int = 64 * MiB  # objects at least this large go up in parts
    multipart_part_size: int = 16 * MiB
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_attempts: int = 5  # per request, with botocore's standard backoff between them
    max_pool_connections: int = 16

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("S3 bucket must not be empty")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both the S3 access key id and the secret access key, or neither")
        if not MIN_PART_BYTES <= self.multipart_part_size <= MAX_PART_BYTES:
            raise ValueError(f"multipart_part_size must be between {MIN_PART_BYTES} and {MAX_PART_BYTES} bytes")
        if self.multipart_threshold < self.multipart_part_size:
            raise ValueError("multipart_threshold must be at least multipart_part_size")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("S3 timeouts must be positive")
        if self.max_attempts < 1 or self.max_pool_connections < 1:
            raise ValueError("max_attempts and max_pool_connections must be at least 1")

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Config:
        if settings.s3_bucket is None:
            raise ValueError("LORAPLEX_S3_BUCKET is not set")
        secret = settings.s3_secret_access_key
        return cls(
            bucket=settings.s3_bucket,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=None if secret is None else secret.get_secret_value(),
            multipart_threshold=settings.s3_multipart_threshold,
            multipart_part_size=settings.s3_multipart_part_size,
        )


def create_s3_client(config: S3Config) -> S3Client:
    """A boto3 S3 client for `config` (thread-safe once created; creation itself is not, so do it once)."""
    boto_config = Config(
        region_name=config.region,
        # MinIO and SeaweedFS serve buckets under the path, not as DNS names; AWS works best virtual-hosted.
        s3={"addressing_style": "path" if config.endpoint_url else "auto"},
        retries={"max_attempts": config.max_attempts, "mode": "standard"},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        max_pool_connections=config.max_pool_connections,
        # boto3 >= 1.36 adds CRC checksums with aws-chunked bodies to every upload by default; several S3
        # clones reject those, and S3 does not require them.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A session per client: boto3's default session is shared module state and not thread-safe.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        config=boto_config,
    )


class _Source(Protocol):
    """Content for a multipart upload, read part by part in worker threads."""

    size: int

    def read(self, offset: int, length: int) -> bytes: ...

    def verify_unchanged(self) -> None: ...


@dataclass(slots=True)
class _BytesSource:
    data: bytes
    size: int

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]

    def verify_unchanged(self) -> None:
        return None


@dataclass(slots=True)
class _FileSource:
    path: Path
    size: int

    def read(self, offset: int, length: int) -> bytes:
        with self.path.open("rb") as source:
            source.seek(offset)
            return source.read(length)

    def verify_unchanged(self) -> None:
        if self.path.stat().st_size != self.size:
            raise ObjectStoreError(f"{self.path} changed size while it was being uploaded")


class S3ObjectStore:
    """ObjectStore on an S3 bucket (AWS, MinIO, SeaweedFS), shared by every replica.

    Objects smaller than the multipart threshold go up in one PutObject. Larger ones go up in parts, read one
    part at a time; if anything fails (or the caller is cancelled) the upload is aborted, so neither an object
    nor stored parts remain. boto3 calls block, so each runs in a worker thread.
    """

    def __init__(self, config: S3Config, *, client: S3Client | None = None) -> None:
        self._config = config
        self._client = create_s3_client(config) if client is None else client

    @property
    def config(self) -> S3Config:
        return self._config

    @property
    def client(self) -> S3Client:
        return self._client

    async def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        validate_key(key)
        if len(data) >= self._config.multipart_threshold:
            return await self._put_multipart(key, _BytesSource(data, len(data)), content_type)
        return await anyio.to_thread.run_sync(self._put_object, key, data, content_type)

    async def put_file(self, key: str, path: Path, *, content_type: str = "application/octet-stream") -> ObjectInfo:
        validate_key(key)
        size = (await anyio.to_thread.run_sync(path.stat)).st_size
        if size >= self._config.multipart_threshold:
            return await self._put_multipart(key, _FileSource(path, size), content_type)
        data = await anyio.to_thread.run_sync(path.read_bytes)
        return await anyio.to_thread.run_sync(self._put_object, key, data, content_type)

    async def get(self, key: str) -> bytes:
        validate_key(key)
        return await anyio.to_thread.run_sync(self._get_object, key)

    async def delete(self, key: str) -> None:
        validate_key(key)

        def delete() -> None:
            with self._errors("delete", key):
                self._client.delete_object(Bucket=self._config.bucket, Key=key)

        await anyio.to_thread.run_sync(delete)

    async def exists(self, key: str) -> bool:
        validate_key(key)

        def exists() -> bool:
            try:
                self._client.head_object(Bucket=self._config.bucket, Key=key)
            except ClientError as exc:
                if _error_code(exc) in _NOT_FOUND_CODES:
                    return False
                raise self._error("head", key, exc) from exc
            except BotoCoreError as exc:
                raise self._error("head", key, exc) from exc
            return True

        return await anyio.to_thread.run_sync(exists)

    async def list(self, prefix: str = "") -> builtins.list[str]:
        validate_prefix(prefix)

        def list_keys() -> builtins.list[str]:
            keys: builtins.list[str] = []
            with self._errors("list", prefix):
                for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self._config.bucket, Prefix=prefix
                ):
                    keys.extend(item["Key"] for item in page.get("Contents", []))
            return sorted(keys)

        return await anyio.to_thread.run_sync(list_keys)

    async def check(self) -> None:
        def head_bucket() -> None:
            try:
                self._client.head_bucket(Bucket=self._config.bucket)
            except (ClientError, BotoCoreError) as exc:
                where = self._config.endpoint_url or f"AWS {self._config.region}"
                raise ObjectStoreError(f"S3 bucket {self._config.bucket!r} at {where} is not usable: {exc}") from exc

        await anyio.to_thread.run_sync(head_bucket)

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self._client.close)

    async def _put_multipart(self, key: str, source: _Source, content_type: str) -> ObjectInfo:
        bucket = self._config.bucket
        # Parts may grow beyond the configured size: S3 allows at most 10,000 of them.
        part_size = max(self._config.multipart_part_size, -(-source.size // MAX_PARTS))
        if part_size > MAX_PART_BYTES:
            raise ObjectStoreError(f"object {_show(key)} of {source.size} bytes is larger than S3 allows")

        def create() -> str:
            with self._errors("start multipart upload of", key):
                response = self._client.create_multipart_upload(Bucket=bucket, Key=key, ContentType=content_type)
            return response["UploadId"]

        # Shielded: a cancellation landing after S3 created the upload but before we hold its id would leak it.
        with anyio.CancelScope(shield=True):
            upload_id = await anyio.to_thread.run_sync(create)
        digest = hashlib.sha256()

        def upload_part(number: int, offset: int) -> CompletedPartTypeDef:
            length = min(part_size, source.size - offset)
            chunk = source.read(offset, length)
            if len(chunk) != length:
                raise ObjectStoreError(f"source of {_show(key)} ended early while it was being uploaded")
            digest.update(chunk)  # parts go up in order, so the digest sees the bytes in order
            with self._errors(f"upload part {number} of", key):
                response = self._client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                )
            return {"PartNumber": number, "ETag": response["ETag"]}

        def complete(parts: builtins.list[CompletedPartTypeDef]) -> None:
            source.verify_unchanged()
            with self._errors("complete multipart upload of", key):
                self._client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )

        try:
            parts: builtins.list[CompletedPartTypeDef] = []
            for number, offset in enumerate(range(0, source.size, part_size), start=1):
                parts.append(await anyio.to_thread.run_sync(upload_part, number, offset))
            # Shielded: once S3 is assembling the object, finishing is the only outcome that stays consistent.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(complete, parts)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._abort, key, upload_id)
            raise
        logger.debug("stored %s (%d bytes, %d parts) in s3://%s", _show(key), source.size, len(parts), bucket)
        return ObjectInfo(key=key, size=source.size, sha256=digest.hexdigest())

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self._config.bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError):
            # The original error matters more; the parts left behind need a bucket lifecycle rule now.
            logger.exception("could not abort multipart upload %s of %s", upload_id, _show(key))

    def _put_object(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        sha256 = hashlib.sha256(data).hexdigest()
        with self._errors("put", key):
            self._client.put_object(Bucket=self._config.bucket, Key=key, Body=data, ContentType=content_type)
        logger.debug("stored %s (%d bytes) in s3://%s", _show(key), len(data), self._config.bucket)
        return ObjectInfo(key=key, size=len(data), sha256=sha256)

    def _get_object(self, key: str) -> bytes:
        with self._errors("get", key):
            response = self._client.get_object(Bucket=self._config.bucket, Key=key)
            with contextlib.closing(response["Body"]) as body:
                return body.read()

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        """Turn boto3's errors into ObjectNotFound / ObjectStoreError, keeping the original as the cause."""
        try:
            yield
        except ClientError as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from exc
            raise self._error(action, key, exc) from exc
        except BotoCoreError as exc:
            raise self._error(action, key, exc) from exc

    def _error(self, action: str, key: str, exc: Exception) -> ObjectStoreError:
        return ObjectStoreError(f"S3 {action} {_show(key)} in bucket {self._config.bucket!r} failed: {exc}")


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def open_object_store(settings: Settings) -> ObjectStore:
    """The store settings ask for: the S3 bucket when LORAPLEX_S3_BUCKET is set, else the local folder."""
    if settings.s3_bucket is not None:
        return S3ObjectStore(S3Config.from_settings(settings))
    return LocalObjectStore(settings.objects_dir)
