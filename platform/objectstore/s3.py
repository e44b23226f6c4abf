"""The S3 object store (AWS, MinIO, SeaweedFS): shared by every replica; large objects go up in parts."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

    from loraplex.platform.settings import Settings

from loraplex.platform.objectstore.base import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStoreError,
    show_key,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
# S3's multipart limits: every part but the last is 5 MiB .. 5 GiB, and an upload has at most 10,000 parts.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024 * MiB
MAX_PARTS = 10_000
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


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
            raise ObjectStoreError(f"object {show_key(key)} of {source.size} bytes is larger than S3 allows")

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
                raise ObjectStoreError(f"source of {show_key(key)} ended early while it was being uploaded")
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
        logger.debug("stored %s (%d bytes, %d parts) in s3://%s", show_key(key), source.size, len(parts), bucket)
        return ObjectInfo(key=key, size=source.size, sha256=digest.hexdigest())

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self._config.bucket, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError):
            # The original error matters more; the parts left behind need a bucket lifecycle rule now.
            logger.exception("could not abort multipart upload %s of %s", upload_id, show_key(key))

    def _put_object(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        sha256 = hashlib.sha256(data).hexdigest()
        with self._errors("put", key):
            self._client.put_object(Bucket=self._config.bucket, Key=key, Body=data, ContentType=content_type)
        logger.debug("stored %s (%d bytes) in s3://%s", show_key(key), len(data), self._config.bucket)
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
        return ObjectStoreError(f"S3 {action} {show_key(key)} in bucket {self._config.bucket!r} failed: {exc}")


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
