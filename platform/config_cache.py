"""What every request reads of the platform's configuration, kept in this process (decision 0035).

A completion reads its API key, its tenant's status and terms, and what its `model` names (an endpoint, a base
model, an adapter): rows that admins and tenants change rarely. `ConfigCache` keeps them in tables of this
process, valid for one *generation*: a random token in the key-value store (Redis in a deployment, shared by every
replica), replaced after every commit that changes a row of a cached kind. Each request reads the token once, when
it is authenticated (`sync`); a token other than the last one seen empties every table. The writer replaces the
token before it answers, so the first request that any replica begins after a change's response reads the change,
as the key cache promised before (decision 0002).

Rules that keep a table from outliving a change:
- a reader stores what it read only if no table was emptied while it read (`Fill`): a request that read the
  database before a change cannot store that after the change was seen;
- the token a change writes is new (random), never an earlier one, so a replica cannot mistake it for its own;
- a commit that changed a cached kind (seen at its flush: `WatchedSession`) empties this process's tables at once
  and is published by the request's session dependency (`publish`) before the response goes out;
- when the store cannot be read, the tables are neither read nor filled (every request reads the database);
- entries age out after `max_age_s`: the bound for a change made behind the platform's back (SQL by hand).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Generic, TypeVar

from redis.exceptions import RedisError
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, UOWTransaction

from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.api_keys.models import ApiKey
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.kv import KeyValueStore

logger = logging.getLogger(__name__)

GENERATION_KEY = "config:generation"
# The kinds of row a cached table holds (or is derived from); a commit changing any of them starts a generation.
CACHED_KINDS = (ApiKey, Tenant, Endpoint, Adapter, BaseModel)
DEFAULT_MAX_AGE_S = 60.0
# A table past this many entries is emptied rather than grown: misses are never stored, so only a very large
# deployment gets here, and it pays one database read per entry to refill.
MAX_ENTRIES = 100_000

# Keys of a session's `info`.
_CACHE = "config_cache"
_FLUSHED_CHANGE = "config_cache.flushed_change"
_COMMITTED_CHANGE = "config_cache.committed_change"

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    expires_at: float  # on the cache's clock


class CacheTable(Generic[K, V]):
    """One kind of cached value by key; emptied with every table of its cache. Misses are never stored."""

    def __init__(self, cache: ConfigCache) -> None:
        self._cache = cache
        self._entries: dict[K, _Entry[V]] = {}

    def get(self, key: K) -> V | None:
        if not self._cache.usable:
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self._cache.now():
            del self._entries[key]
            return None
        return entry.value

    def put(self, key: K, value: V, fill: Fill) -> None:
        """Store `value`, read since `fill` began, unless a change was seen since then."""
        if not fill.current:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = _Entry(value, self._cache.now() + self._cache.max_age_s)

    def clear(self) -> None:
        self._entries.clear()


@dataclass(frozen=True, slots=True)
class Fill:
    """A read of the database for a table, begun in `epoch`: `current` until the tables are next emptied."""

    cache: ConfigCache
    epoch: int

    @property
    def current(self) -> bool:
        return self.cache.usable and self.cache.epoch == self.epoch


@dataclass(frozen=True, slots=True)
class Basis:
    """The tables' state when a request began its lookups without reading the generation first. Its lookups stand
    if, when the request reads the generation afterwards (one read after the request began, as `sync` would have
    made), the tables were not emptied meanwhile and held that generation: nothing changed before the request began
    that they do not show. Otherwise the request drops what it looked up and does it again, after `adopt`.
    `token` None: the tables were not usable, so the lookups read the database (the authenticator reads the
    generation first then: a basis is only taken of usable tables)."""

    token: bytes | None
    epoch: int


class ConfigCache:
    """This process's cached configuration; one per process (in `Resources`), safe for concurrent requests (they
    share one event loop)."""

    def __init__(
        self, kv: KeyValueStore, *, max_age_s: float = DEFAULT_MAX_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self._kv = kv
        self.max_age_s = max_age_s
        self.now = clock
        self._tables: list[CacheTable[Any, Any]] = []
        self._token: bytes | None = None  # the generation the tables hold; None: not read yet, or unreadable
        self.epoch = 0  # counts the times the tables were emptied

    @property
    def usable(self) -> bool:
        """Whether the tables may be read and filled: the last `sync` read the generation."""
        return self._token is not None

    def table(self) -> CacheTable[Any, Any]:
        """A new table of this cache (its owner types it: `CacheTable[K, V]`)."""
        table: CacheTable[Any, Any] = CacheTable(self)
        self._tables.append(table)
        return table

    def fill(self) -> Fill:
        """Call before reading what a table misses; `put` what was read with it."""
        return Fill(self, self.epoch)

    async def sync(self) -> None:
        """Read the generation; if it is not the one the tables hold, empty them. Every request calls this once,
        before its first lookup (the authenticator does), unless it checks its lookups afterwards (`basis`)."""
        self.adopt(await self.read_generation())

    async def read_generation(self) -> bytes | None:
        """The generation in the store (one is started if it has none); None when the store cannot be read."""
        try:
            token = await self._kv.get(GENERATION_KEY)
            if token is None:  # never set, or the store lost it: start one (another replica may start it first)
                await self._kv.set(GENERATION_KEY, new_token(), only_if_absent=True)
                token = await self._kv.get(GENERATION_KEY)
        except (RedisError, OSError):
            logger.warning("config cache: the generation cannot be read; reading the database", exc_info=True)
            return None
        return token

    def adopt(self, token: bytes | None) -> None:
        """Take `token`, read in the store (None: it could not be), as the generation: the tables are emptied unless
        they hold that generation already."""
        if token != self._token or token is None:
            self._token = token
            self.invalidate()

    def basis(self) -> Basis:
        """What lookups made from now on rely on, for a request that reads the generation after them rather than
        before (the completions path reads it in its admission's round trip): see `Basis`."""
        return Basis(self._token, self.epoch)

    def holds(self, basis: Basis) -> bool:
        """Whether the tables are still those of `basis` (not emptied since): lookups made since are of one
        generation, `basis.token`."""
        return self.epoch == basis.epoch

    def confirms(self, basis: Basis, token: bytes | None) -> bool:
        """Whether lookups made since `basis` stand, `token` being the generation read in the store after the
        request began: the tables were not emptied since, and held that generation (or were not used at all)."""
        return self.holds(basis) and (basis.token is None or basis.token == token)

    async def verify(self, basis: Basis) -> bool:
        """Read the generation now and adopt it; whether lookups made since `basis` stand (`confirms`). For a
        request whose lookups refused it before it read the generation: a refusal that does not stand is redone."""
        token = await self.read_generation()
        confirmed = self.confirms(basis, token)
        self.adopt(token)
        return confirmed

    def invalidate(self) -> None:
        """Empty every table of this process now (a commit here changed a cached kind)."""
        self.epoch += 1
        for table in self._tables:
            table.clear()

    async def publish(self) -> None:
        """Start a new generation, for every replica: call after a commit that changed a cached kind, before
        answering. Failing that (the store is down), other replicas see the change after `max_age_s`."""
        self.invalidate()
        token = new_token()
        try:
            await self._kv.set(GENERATION_KEY, token)
        except (RedisError, OSError):
            logger.warning(
                "config cache: a change could not be published; other replicas see it within %.0f s",
                self.max_age_s,
                exc_info=True,
            )
            return
        # Everything in the tables now was read after the change committed: this generation's already.
        self._token = token

    async def publish_changes(self, session: AsyncSession) -> None:
        """Publish what `session` committed, if it changed a cached kind: the request's session dependency calls
        this as the session ends, before the response goes out."""
        if session.info.pop(_COMMITTED_CHANGE, False):
            await self.publish()


def watch_sessions(sessions: async_sessionmaker[AsyncSession], cache: ConfigCache) -> None:
    """Make every session of `sessions` report to `cache` the commits that change a cached kind."""
    sessions.configure(sync_session_class=WatchedSession, info={_CACHE: cache})


def new_token() -> bytes:
    return secrets.token_hex(16).encode()


class WatchedSession(Session):
    """A session that tells its `ConfigCache` (in its `info`) when a commit changed a cached kind: at once for this
    process, and through `ConfigCache.publish_changes` for the others."""


@event.listens_for(WatchedSession, "after_flush")
def _flushed(session: Session, _: UOWTransaction) -> None:
    # Still the flush's own lists here (SQLAlchemy gives after_flush the pre-flush state).
    if any(isinstance(row, CACHED_KINDS) for row in chain(session.new, session.dirty, session.deleted)):
        session.info[_FLUSHED_CHANGE] = True


@event.listens_for(WatchedSession, "after_commit")
def _committed(session: Session) -> None:
    # Not cleared by a rollback: a savepoint's rollback must not hide an earlier flush of the same transaction,
    # and an extra generation costs only a refill.
    if session.info.pop(_FLUSHED_CHANGE, False):
        session.info[_COMMITTED_CHANGE] = True
        cache = session.info.get(_CACHE)
        if isinstance(cache, ConfigCache):
            cache.invalidate()
