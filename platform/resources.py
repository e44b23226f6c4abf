"""The connections one platform process holds (database, key-value store, object store), opened and closed together.

`Resources.open` is what the app's lifespan and the CLI call; nothing else creates connections.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from loraplex.engine import AsyncEngine as EngineRuntime
from loraplex.platform.admission import Admitter, open_gate
from loraplex.platform.auth import Authenticator
from loraplex.platform.concurrency import Leases, open_leases
from loraplex.platform.config_cache import ConfigCache, watch_sessions
from loraplex.platform.console.security import SignInThrottle
from loraplex.platform.console.sessions import SessionStore
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.db.migrate import ensure_at_head
from loraplex.platform.domain.api_keys.keys import KeyHasher
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.base_models.service import ModelConfigs
from loraplex.platform.domain.completions.lookups import CompletionLookups
from loraplex.platform.domain.fleet.embedded import (
    embedded_model,
    embedded_quantization,
    embedded_reasoning_config,
    embedded_speculative_config,
    start_embedded_fleet,
)
from loraplex.platform.domain.fleet.registry import EmptyFleet, Fleet, RedisFleet, Router
from loraplex.platform.domain.usage.recorder import UsageRecorder, open_usage_recorder
from loraplex.platform.jobs.worker import JobWorker
from loraplex.platform.kv import KeyValueStore, RedisStore, open_kv_store
from loraplex.platform.metrics import CountingLeases, CountingRateLimiter, PlatformMetrics
from loraplex.platform.objectstore import ObjectStore, open_object_store
from loraplex.platform.ratelimit import RateLimiter, open_rate_limiter
from loraplex.platform.settings import Settings, SettingsError

logger = logging.getLogger(__name__)


def read_or_create_secret(path: Path) -> str:
    """A random secret kept in `path` (mode 0600), created on first use; for the single-machine embedded mode."""
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value


def resolve_secret_key(settings: Settings) -> bytes:
    """The key API keys are hashed under: from settings, or (embedded SQLite only) a file in the data dir.

    Replicas behind one database must share it, so a shared database without LORAPLEX_SECRET_KEY is refused
    rather than letting each replica invent its own and reject the others' keys.
    """
    if settings.secret_key is not None:
        value = settings.secret_key.get_secret_value()
        if len(value) < 16:
            raise SettingsError("invalid settings: LORAPLEX_SECRET_KEY: must be at least 16 characters")
        return value.encode()
    if not settings.effective_database_url.startswith("sqlite"):
        raise SettingsError(
            "invalid settings: LORAPLEX_SECRET_KEY is required with a shared database "
            "(every replica must hash API keys with the same key)"
        )
    return read_or_create_secret(settings.data_dir / "secret_key").encode()


@dataclass
class Resources:
    settings: Settings
    db_engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    kv: KeyValueStore
    objects: ObjectStore
    hasher: KeyHasher
    authenticator: Authenticator
    config_cache: ConfigCache  # what requests read of keys, tenants, endpoints and models (decision 0035)
    lookups: CompletionLookups  # the completions path's cached reads, in `config_cache`
    model_configs: ModelConfigs
    rate_limiter: RateLimiter
    leases: Leases  # per-tenant concurrency caps
    admitter: Admitter  # a completion's rate limits and lease, in one round trip (decision 0038)
    usage: UsageRecorder
    fleet: Fleet
    router: Router
    metrics: PlatformMetrics  # this process's Prometheus series, in a registry of its own
    console_sessions: SessionStore
    sign_in_throttle: SignInThrottle
    embedded_engine: EngineRuntime | None = None
    jobs: JobWorker | None = None  # the app's job worker (background responses): its lifespan starts and stops it

    @classmethod
    async def open(cls, settings: Settings, *, check_migrations: bool = True, with_engines: bool = True) -> Resources:
        """Open every connection; raise (after closing what was opened) if any dependency is unusable."""
        hasher = KeyHasher(resolve_secret_key(settings))
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        db_engine = create_engine(
            settings.effective_database_url,
            pool_size=settings.database_pool_size,
            statement_timeout_s=settings.database_statement_timeout_s,
            pool_timeout_s=settings.database_pool_timeout_s,
        )
        kv: KeyValueStore | None = None
        objects: ObjectStore | None = None
        try:
            if check_migrations:
                await ensure_at_head(db_engine)
            kv = open_kv_store(settings.redis_url, prefix=settings.redis_prefix, timeout_s=settings.redis_timeout_s)
            await kv.ping()
            objects = open_object_store(settings)
            await objects.check()
        except BaseException:
            if objects is not None:
                await objects.close()
            if kv is not None:
                await kv.close()
            await db_engine.dispose()
            raise
        sessions = create_session_factory(db_engine)
        config_cache = ConfigCache(kv)
        watch_sessions(sessions, config_cache)
        try:
            fleet, embedded = await _open_fleet(settings, kv, sessions) if with_engines else (EmptyFleet(), None)
        except BaseException:
            await objects.close()
            await kv.close()
            await db_engine.dispose()
            raise
        admin_token = settings.admin_token.get_secret_value() if settings.admin_token is not None else None
        authenticator = Authenticator(
            sessions, kv, hasher, config_cache, admin_token=admin_token, cache_ttl_s=settings.key_cache_ttl_s
        )
        rate_limiter = open_rate_limiter(kv, settings)
        leases = open_leases(kv, settings)
        usage = open_usage_recorder(sessions, kv)
        metrics = PlatformMetrics(rate_limiter, usage)
        return cls(
            settings=settings,
            db_engine=db_engine,
            sessions=sessions,
            kv=kv,
            objects=objects,
            hasher=hasher,
            authenticator=authenticator,
            config_cache=config_cache,
            lookups=CompletionLookups(sessions, settings, config_cache),
            model_configs=ModelConfigs(settings),
            rate_limiter=CountingRateLimiter(rate_limiter, metrics),
            leases=CountingLeases(leases, metrics),
            admitter=Admitter(open_gate(config_cache, rate_limiter, leases), metrics),
            usage=usage,
            fleet=fleet,
            router=Router(fleet, kv),
            metrics=metrics,
            console_sessions=SessionStore(kv, ttl_s=settings.console_session_ttl_s),
            sign_in_throttle=SignInThrottle(kv, attempts_per_minute=settings.console_sign_in_attempts_per_minute),
            embedded_engine=embedded,
        )

    async def close(self) -> None:
        try:
            await self.admitter.settled()  # lease releases still on their way: through the store, not cut off
            await self.fleet.close()
            if self.embedded_engine is not None:
                await self.embedded_engine.shutdown()
            await self.objects.close()
            await self.kv.close()
        finally:
            await self.db_engine.dispose()


async def _open_fleet(
    settings: Settings, kv: KeyValueStore, sessions: async_sessionmaker[AsyncSession]
) -> tuple[Fleet, EngineRuntime | None]:
    """The engines completions go to: the in-process one (embedded), the Redis registry (fleet), or none."""
    if settings.engine_mode == "off":
        return EmptyFleet(), None
    if settings.engine_mode == "fleet":
        if not isinstance(kv, RedisStore):
            raise SettingsError("invalid settings: LORAPLEX_ENGINE_MODE=fleet needs LORAPLEX_REDIS_URL (the registry)")
        api_key = settings.engine_api_key.get_secret_value() if settings.engine_api_key is not None else None
        return RedisFleet(kv, api_key=api_key), None
    name, _ = embedded_model(settings)
    async with sessions() as session:
        registered = await BaseModelRepository(session).get_by_name(name)
        quantization = embedded_quantization(settings, registered.quantization if registered else None)
        speculative = embedded_speculative_config(settings, registered.speculative_config if registered else None)
        reasoning = embedded_reasoning_config(
            name, registered.reasoning_config if registered else None, first_start=registered is None
        )
    fleet, engine, name, path = await start_embedded_fleet(settings, quantization, speculative, reasoning)
    async with sessions() as session:
        # The embedded engine's model is a base model like any other, registered on first start; its record says
        # the quantization and speculation served (LORAPLEX_ENGINE_* may have changed them since).
        models = BaseModelRepository(session)
        row = await models.get_by_name(name)
        if row is None:
            row = BaseModel(name=name, source=str(path), quantization=quantization)
            row.set_reasoning(reasoning)  # the record is where reasoning is set: only on first start
            row = await models.add(row)
        row.quantization = quantization
        row.set_speculative(speculative)
        await session.commit()
    return fleet, engine
