"""Object storage for adapter artifacts: an S3 bucket (shared by every replica) or a local folder (embedded mode).

Keys are "/"-separated relative paths, e.g. `tenants/{tenant_id}/adapters/{adapter_id}/adapter_model.safetensors`.
Every method validates its key (or prefix) before touching a file or the network. Writes are all-or-nothing: a
failed put leaves no partial object behind, and on S3 no unfinished multipart upload either. Blocking work (file
I/O, boto3 calls, hashing) runs in worker threads so the event loop keeps serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.platform.objectstore.base import (
    InvalidObjectKey,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    validate_key,
    validate_prefix,
)
from loraplex.platform.objectstore.local import LocalObjectStore
from loraplex.platform.objectstore.s3 import S3Config, S3ObjectStore, create_s3_client

if TYPE_CHECKING:
    from loraplex.platform.settings import Settings

__all__ = [
    "InvalidObjectKey",
    "LocalObjectStore",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectStoreError",
    "S3Config",
    "S3ObjectStore",
    "create_s3_client",
    "open_object_store",
    "validate_key",
    "validate_prefix",
]


def open_object_store(settings: Settings) -> ObjectStore:
    """The store settings ask for: the S3 bucket when LORAPLEX_S3_BUCKET is set, else the local folder."""
    if settings.s3_bucket is not None:
        return S3ObjectStore(S3Config.from_settings(settings))
    return LocalObjectStore(settings.objects_dir)
