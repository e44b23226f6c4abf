"""The local-folder object store of the embedded mode: atomic writes, every path confined to the root."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    pass

from loraplex.platform.objectstore.base import (
    InvalidObjectKey,
    ObjectInfo,
    ObjectNotFound,
    ObjectStoreError,
    show_key,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
_COPY_CHUNK_BYTES = 1 * MiB
# Names of in-progress temporary files in the local store; keys with a segment starting with it are refused there.
_LOCAL_TMP_PREFIX = ".lpx-partial-"


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
            raise InvalidObjectKey(f"object key {show_key(key)}: segments starting {_LOCAL_TMP_PREFIX!r} are reserved")

    def _path(self, key: str) -> Path:
        # Defense in depth: validate_key already refuses "..", but a symlink inside root could still lead out.
        root = self._root.resolve()
        path = (root / key).resolve()
        if path == root or not path.is_relative_to(root):
            raise InvalidObjectKey(f"object key {show_key(key)} resolves outside the store")
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
            raise ObjectStoreError(
                f"object key {show_key(key)} is a folder of other objects in the local store"
            ) from None
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        logger.debug("stored %s (%d bytes) in %s", show_key(key), size, self._root)
        return ObjectInfo(key=key, size=size, sha256=sha256)

    def _create_temp(self, key: str, folder: Path) -> tuple[int, str]:
        # A concurrent delete prunes empty folders, and may do so between our mkdir and mkstemp: try once more.
        for attempt in range(2):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                return tempfile.mkstemp(prefix=_LOCAL_TMP_PREFIX, dir=folder)
            except (FileExistsError, NotADirectoryError):
                raise ObjectStoreError(
                    f"object key {show_key(key)} lies under another object in the local store"
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
