"""A small key-value interface over Redis, with an in-process substitute for the embedded single-process mode.

Only what the control plane needs lives here; both implementations keep the same semantics (TTLs, set-if-absent)
so code above never asks which one it holds.
"""

from __future__ import annotations

import time
from typing import Protocol

from redis.asyncio import Redis


class KeyValueStore(Protocol):
    """Bytes values under string keys. Keys are namespaced by the implementation (Redis key prefix)."""

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, *, ttl_s: float | None = None, only_if_absent: bool = False) -> bool:
        """Store `value`; with `only_if_absent`, only when no live value exists. Returns whether it was stored."""
        ...

    async def delete(self, *keys: str) -> int: ...

    async def incr(self, key: str, *, ttl_s: float) -> int:
        """Add 1 to the counter under `key` and return it; a new counter lives `ttl_s` (a fixed window)."""
        ...

    async def ping(self) -> None:
        """Raise if the store cannot be reached."""
        ...

    async def close(self) -> None: ...


class RedisStore:
    """KeyValueStore on Redis: shared by every replica, so writes are seen everywhere at once."""

    def __init__(self, url: str, *, prefix: str, timeout_s: float = 2.0) -> None:
        # Every caller copes with Redis failing (decision 0009's failure policy, the key cache reading the database),
        # so a frozen Redis should fail fast: `timeout_s` bounds each command and each connect.
        self._redis: Redis = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix = prefix

    @property
    def redis(self) -> Redis:
        """The client, for the callers that need Redis itself (rate limits, streams); keys must use `key()`."""
        return self._redis

    def key(self, key: str) -> str:
        return self._prefix + key

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(self.key(key))
        # The client is built without decode_responses, so values come back as bytes.
        return value.encode() if isinstance(value, str) else value

    async def set(self, key: str, value: bytes, *, ttl_s: float | None = None, only_if_absent: bool = False) -> bool:
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        stored = await self._redis.set(self.key(key), value, px=px, nx=only_if_absent)
        return bool(stored)

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        return int(await self._redis.delete(*(self.key(k) for k in keys)))

    async def incr(self, key: str, *, ttl_s: float) -> int:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incr(self.key(key))
            pipe.pexpire(self.key(key), max(1, int(ttl_s * 1000)), nx=True)
            count, _ = await pipe.execute()
        return int(count)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


class MemoryStore:
    """KeyValueStore in this process's memory: correct only while one process serves (the embedded mode)."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[bytes, float | None]] = {}

    def _live(self, key: str) -> bytes | None:
        entry = self._values.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        if expires_at is not None and expires_at <= time.monotonic():
            del self._values[key]
            return None
        return value

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def set(self, key: str, value: bytes, *, ttl_s: float | None = None, only_if_absent: bool = False) -> bool:
        if only_if_absent and self._live(key) is not None:
            return False
        self._values[key] = (value, None if ttl_s is None else time.monotonic() + ttl_s)
        return True

    async def delete(self, *keys: str) -> int:
        return sum(1 for k in keys if self._values.pop(k, None) is not None)

    async def incr(self, key: str, *, ttl_s: float) -> int:
        live = self._live(key)
        count = int(live) + 1 if live is not None else 1
        expires_at = self._values[key][1] if live is not None else time.monotonic() + ttl_s
        self._values[key] = (str(count).encode(), expires_at)
        return count

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._values.clear()


def open_kv_store(redis_url: str | None, *, prefix: str, timeout_s: float = 2.0) -> KeyValueStore:
    """Redis when a URL is configured, else the in-process substitute."""
    if redis_url is None:
        return MemoryStore()
    return RedisStore(redis_url, prefix=prefix, timeout_s=timeout_s)
