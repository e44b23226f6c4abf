"""Fleet registration: an engine server announces itself in Redis, so that the platform's router can find it and
see its load (DESIGN: engine replicas "register themselves in Redis").

The registry, whose record (`FleetRecord`) and keys are defined here only: the platform's router reads them
(`loraplex.platform.domain.fleet.registry`). `{prefix}` is the server's --redis-prefix ("loraplex:" by default),
the same prefix as the platform's keys:

    {prefix}fleet:engines         a set of engine ids: SADD on every beat, SREM on a clean shutdown
    {prefix}fleet:engine:{id}     one JSON object per engine, SET every second with a 5 s expiry (PX 5000):
        {
          "id": "gpu-3:8100",             --engine-id (default: hostname:port)
          "url": "http://gpu-3:8100",     --public-url, where the platform sends requests (default: http://host:port)
          "base_model": "llama-3-8b",     --base-model-name, the platform's name of the base model (default: the
                                          served model name); the server also accepts it as `model` in requests
          "adapters": ["sha256:..."],     content digests of the adapters resident in the pool now, sorted
          "free_pages": 1200,             pool pages free now
          "evictable_pages": 300,         held pages an allocation may take back (cached KV blocks, idle adapters)
          "num_pages": 4096,              the pool's size (KV blocks and adapter weights share it)
          "num_waiting": 0,               requests queued (waiting for pages, a step's budget, or their adapter)
          "num_running": 3,               requests running
          "max_model_len": 8192,          prompt + completion tokens one request may have
          "role": "both",                 --role: "prefill", "decode" or "both" (the platform sends a prompt's
                                          prefill to a prefill engine and its decode to a decode engine when the
                                          base model has both; "both" serves either half, or a whole request)
          "updated_at": 1733312345.123    unix seconds of this beat
        }

A member of the set without a key has missed its beats (crashed, cut off): readers skip it and may SREM it. An
engine whose thread has failed withdraws itself (DEL + SREM) at its next beat instead of waiting for the expiry.
Redis errors are logged and retried at the next beat; they never stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

if TYPE_CHECKING:
    from loraplex.engine.serve.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_PREFIX: Final = "loraplex:"
ENGINES_SET: Final = "fleet:engines"
ENGINE_KEY: Final = "fleet:engine:{id}"
_REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")
_WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::"})  # noqa: S104  # bind addresses, not places to call
ROLES: Final = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class FleetRecord:
    """One engine's registry entry (the module's docstring gives each field)."""

    id: str
    url: str
    base_model: str
    adapters: frozenset[str] = frozenset()  # digests of resident adapters
    free_pages: int = 0
    evictable_pages: int = 0  # held by idle adapters or cached KV: an allocation can take them back
    num_pages: int = 0
    num_waiting: int = 0
    num_running: int = 0
    max_model_len: int = 0
    updated_at: float = 0.0
    role: str = "both"  # one of ROLES

    @property
    def load(self) -> float:
        """Queued requests weigh 2, running ones 1, plus the share of the pool in use."""
        available = self.free_pages + self.evictable_pages
        used = 0.0 if self.num_pages == 0 else 1 - available / self.num_pages
        return self.num_waiting * 2 + self.num_running + used

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> FleetRecord:
        """Raise KeyError, ValueError or TypeError for an entry that is not a record."""
        return cls(
            id=str(raw["id"]),
            url=str(raw["url"]),
            base_model=str(raw["base_model"]),
            adapters=frozenset(raw.get("adapters") or ()),
            free_pages=int(raw.get("free_pages", 0)),
            evictable_pages=int(raw.get("evictable_pages", 0)),
            num_pages=int(raw.get("num_pages", 0)),
            num_waiting=int(raw.get("num_waiting", 0)),
            num_running=int(raw.get("num_running", 0)),
            max_model_len=int(raw.get("max_model_len", 0)),
            updated_at=float(raw.get("updated_at", 0.0)),
            role=_role(raw.get("role", "both")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "base_model": self.base_model,
            "adapters": sorted(self.adapters),
            "free_pages": self.free_pages,
            "evictable_pages": self.evictable_pages,
            "num_pages": self.num_pages,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "max_model_len": self.max_model_len,
            "updated_at": self.updated_at,
            "role": self.role,
        }


def _role(value: Any) -> str:
    if value not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {value!r}")
    return str(value)


@dataclass(frozen=True, slots=True)
class RegistrationConfig:
    redis_url: str
    engine_id: str
    url: str  # where the platform calls this server
    base_model: str | None = None  # the platform's name of the base model; None: the served model name
    prefix: str = DEFAULT_PREFIX
    interval_s: float = 1.0  # between beats
    ttl_s: float = 5.0  # a key's life: missing this many seconds of beats drops the engine from the fleet
    role: str = "both"  # what the platform sends it: prefills, decodes or both (ROLES)

    def __post_init__(self) -> None:
        _role(self.role)
        if not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(f"redis_url must start with {', '.join(_REDIS_SCHEMES)}")
        if not self.engine_id or not self.engine_id.isprintable() or any(c.isspace() for c in self.engine_id):
            raise ValueError("engine_id must be printable, without spaces")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("url (the public URL) must start with http:// or https://")
        if self.base_model is not None and not self.base_model:
            raise ValueError("base_model must not be empty")
        if not 0 < self.interval_s < self.ttl_s:
            raise ValueError("interval_s must be positive and shorter than ttl_s")

    @property
    def engines_key(self) -> str:
        return self.prefix + ENGINES_SET

    @property
    def engine_key(self) -> str:
        return self.prefix + ENGINE_KEY.format(id=self.engine_id)


def default_engine_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


def default_public_url(host: str, port: int) -> str:
    """http://host:port, with this machine's name for a wildcard bind address (which no one can call)."""
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    elif ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{port}"


def engine_record(engine: AsyncEngine, engine_id: str, url: str, base_model: str, role: str = "both") -> FleetRecord:
    """An engine's registry entry now, from the engine thread's latest snapshot: what a fleet engine announces in
    Redis and what the platform's embedded engine hands its router."""
    from loraplex.engine.lora.manager import AdapterState  # here: the registry format needs no torch

    state = engine.state()
    return FleetRecord(
        id=engine_id,
        url=url,
        base_model=base_model,
        adapters=frozenset(d for d, s in engine.adapter_states().items() if s is AdapterState.RESIDENT),
        free_pages=state.pool.num_free,
        evictable_pages=state.pool.num_evictable,
        num_pages=state.pool.num_pages,
        num_waiting=state.num_waiting,
        num_running=state.num_running,
        max_model_len=engine.core.max_model_len,
        updated_at=time.time(),
        role=role,
    )


class FleetRegistration:
    """Beats for one engine while `running()` is entered; withdraws it on the way out.

    Owns its Redis client; lives on the server's event loop.
    """

    def __init__(self, engine: AsyncEngine, config: RegistrationConfig) -> None:
        self.engine = engine
        self.config = config
        self.base_model = config.base_model or engine.core.served_model_name
        # No retries inside a beat: the next beat is the retry, and a beat must not outlive its interval by much.
        timeout = min(2.0, config.ttl_s / 2)
        self._redis: Redis = Redis.from_url(
            config.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        self._failing = False  # the previous beat failed (log the first failure and the recovery only)
        self._withdrawn = False
        self.num_failed_beats = 0  # over the server's life

    async def beat(self) -> None:
        """Write this engine's entry (or withdraw it if the engine has failed). Raises the Redis client's errors."""
        if not self.engine.is_healthy:
            if not self._withdrawn:
                logger.error("the engine has failed: withdrawing %s from the fleet", self.config.engine_id)
                await self.withdraw()
                self._withdrawn = True
            return
        entry = engine_record(self.engine, self.config.engine_id, self.config.url, self.base_model, self.config.role)
        record = json.dumps(entry.to_json(), separators=(",", ":"))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self.config.engine_key, record, px=int(self.config.ttl_s * 1000))
            pipe.sadd(self.config.engines_key, self.config.engine_id)
            await pipe.execute()

    async def withdraw(self) -> None:
        """Remove this engine from the registry (its key and its set member)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.config.engine_key)
            pipe.srem(self.config.engines_key, self.config.engine_id)
            await pipe.execute()

    async def _beat_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await asyncio.wait_for(self.beat(), timeout=self.config.interval_s * 2)
            except Exception as exc:  # Redis down, a timeout, a refused write: the next beat tries again
                self.num_failed_beats += 1
                if not self._failing:
                    logger.warning("fleet registration in %s failed (retrying every beat): %r", self._where(), exc)
                self._failing = True
            else:
                if self._failing:
                    logger.info("fleet registration in %s works again", self._where())
                self._failing = False
            await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - started)))

    def _where(self) -> str:
        # The URL may carry a password: name only what an operator needs to find the server.
        kwargs = self._redis.connection_pool.connection_kwargs
        return str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Beat in the background until the block ends; then withdraw (best effort) and close the client."""
        logger.info(
            "registering engine %s (%s, base model %s) in %s under %s",
            self.config.engine_id,
            self.config.url,
            self.base_model,
            self._where(),
            self.config.prefix,
        )
        task = asyncio.create_task(self._beat_forever(), name="loraplex-fleet-registration")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            try:
                await asyncio.wait_for(self.withdraw(), timeout=2.0)
            except Exception as exc:  # the key expires on its own in ttl_s
                logger.warning("could not withdraw engine %s from the fleet: %r", self.config.engine_id, exc)
            await self._redis.aclose()


__all__ = [
    "DEFAULT_PREFIX",
    "ENGINES_SET",
    "ENGINE_KEY",
    "ROLES",
    "FleetRecord",
    "FleetRegistration",
    "RegistrationConfig",
    "default_engine_id",
    "default_public_url",
    "engine_record",
]
