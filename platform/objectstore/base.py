"""Object store contract: the interface, its errors, and the key rules both implementations apply."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    pass


MAX_KEY_BYTES = 1024  # S3's limit, applied to the local store too so both accept the same keys


class ObjectStoreError(Exception):
    """The object store refused or failed an operation."""


class ObjectNotFound(ObjectStoreError, KeyError):
    """No object has this key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        # KeyError's own __str__ shows repr(args[0]) only; say what is missing.
        return f"no object with key {show_key(self.key)}"


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
        raise InvalidObjectKey(f"object key {show_key(key)} is not valid UTF-8") from None
    if size > MAX_KEY_BYTES:
        raise InvalidObjectKey(f"object key is {size} bytes long; at most {MAX_KEY_BYTES} are allowed")
    if key.startswith("/"):
        raise InvalidObjectKey(f"object key {show_key(key)} must be relative (no leading '/')")
    if "\\" in key:
        raise InvalidObjectKey(f"object key {show_key(key)} must not contain a backslash")
    if any(_is_control(char) for char in key):
        raise InvalidObjectKey(f"object key {show_key(key)} must not contain control characters")
    for segment in key.split("/"):
        if segment == "":
            raise InvalidObjectKey(f"object key {show_key(key)} has an empty path segment")
        if segment in (".", ".."):
            raise InvalidObjectKey(f"object key {show_key(key)} must not contain '.' or '..' segments")
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


def show_key(key: str) -> str:
    # Keys can be a megabyte of hostile text; error messages and logs get the start of it.
    return repr(key) if len(key) <= 80 else repr(key[:80]) + "..."


# --- local folder --------------------------------------------------------------------------------------------
