"""Who is calling: tenant keys on `/v1`, admin tokens and keys on `/admin`.

Key lookups are cached at two levels. In process memory, by the `ConfigCache` (decision 0035): authenticating a
tenant request first reads the cache's generation, which every change replaces, so a change made on one replica is
seen by every replica on its next request. Behind it, in the shared key-value store (Redis), where two rules keep an
entry from ever outliving a change:
- a cache miss fills the entry only if it is still absent (SET NX), so a request that read the database before a
  change cannot overwrite what the change wrote;
- a change writes its new truth into the cache after its transaction commits (`key_changed`, `tenant_changed`).
If the store is unreachable, authentication reads the database directly.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from dataclasses import dataclass

from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.config_cache import Basis, CacheTable, ConfigCache
from loraplex.platform.domain.api_keys.keys import KeyHasher, KeyKind, parse_key
from loraplex.platform.domain.api_keys.repository import (
    AdminKeyRepository,
    ApiKeyRepository,
    KeyForAuthentication,
)
from loraplex.platform.domain.tenants.models import TenantStatus
from loraplex.platform.domain.tenants.repository import TenantRepository
from loraplex.platform.errors import ApiError, invalid_api_key
from loraplex.platform.ids import AdminKeyId, ApiKeyId, TenantId
from loraplex.platform.kv import KeyValueStore

logger = logging.getLogger(__name__)

MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


@dataclass(frozen=True, slots=True)
class TenantPrincipal:
    tenant_id: TenantId
    key_id: ApiKeyId


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    key_id: AdminKeyId | None  # None: the bootstrap admin token from settings


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True, slots=True)
class _CachedKey:
    """The cache entry of one key: everything but the tenant's status, which is cached under its own name."""

    tenant_id: TenantId
    key_hash: str
    revoked: bool

    @classmethod
    def of(cls, key: KeyForAuthentication) -> _CachedKey:
        return cls(tenant_id=key.tenant_id, key_hash=key.key_hash, revoked=key.revoked)

    def encode(self) -> bytes:
        return json.dumps({"tenant_id": str(self.tenant_id), "hash": self.key_hash, "revoked": self.revoked}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> _CachedKey:
        entry = json.loads(raw)
        return cls(
            tenant_id=TenantId(uuid.UUID(entry["tenant_id"])),
            key_hash=entry["hash"],
            revoked=entry["revoked"],
        )


class Authenticator:
    """Resolves Authorization headers to principals. One per process; safe for concurrent requests."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        kv: KeyValueStore,
        hasher: KeyHasher,
        config_cache: ConfigCache,
        *,
        admin_token: str | None,
        cache_ttl_s: float,
    ) -> None:
        self._sessions = sessions
        self._kv = kv
        self._hasher = hasher
        self._config_cache = config_cache
        self._keys: CacheTable[ApiKeyId, _CachedKey] = config_cache.table()
        self._statuses: CacheTable[TenantId, str] = config_cache.table()
        self._admin_token = admin_token
        self._ttl_s = cache_ttl_s

    async def tenant(self, authorization: str | None, *, sync: bool = True) -> TenantPrincipal:
        """The principal of a tenant key. `sync` False: the configuration generation is not read first (the
        caller has read it during this request, or checks the lookups against it afterwards: `tenant_checked_later`)."""
        token = bearer_token(authorization)
        if token is None:
            raise invalid_api_key(MISSING_KEY)
        parsed = parse_key(token)
        if parsed is None or parsed.kind is not KeyKind.TENANT:
            raise invalid_api_key()
        if sync:
            await self._config_cache.sync()  # once per request, before any of its cached lookups
        key = await self._lookup_key(ApiKeyId(parsed.key_id))
        if key is None or not self._hasher.verify(parsed.full_key, key.key_hash):
            raise invalid_api_key()
        if key.revoked:
            raise invalid_api_key("This API key has been revoked.")
        status = await self._tenant_status(key.tenant_id)
        if status != TenantStatus.ACTIVE.value:
            raise ApiError(401, "This API key belongs to a suspended account.", code="account_suspended")
        return TenantPrincipal(tenant_id=key.tenant_id, key_id=ApiKeyId(parsed.key_id))

    async def tenant_checked_later(self, authorization: str | None) -> tuple[TenantPrincipal, Basis | None]:
        """`tenant` for a request that reads the configuration generation after its lookups (a completion, in its
        admission's round trip), with the `Basis` to check them against then; None: the generation was read here
        already (so it is when the tables are not usable: at start, or while the store cannot be read). A refusal is
        checked at once: if the generation changed, the key is looked up again."""
        if not self._config_cache.usable:
            return await self.tenant(authorization), None
        basis = self._config_cache.basis()
        try:
            return await self.tenant(authorization, sync=False), basis
        except ApiError:
            if await self._config_cache.verify(basis):
                raise
        return await self.tenant(authorization, sync=False), None

    async def admin(self, authorization: str | None) -> AdminPrincipal:
        token = bearer_token(authorization)
        headers = {"WWW-Authenticate": "Bearer"}
        if token is None:
            raise ApiError(401, "An admin token is required.", code="unauthenticated", headers=headers)
        if self._admin_token is not None and hmac.compare_digest(token.encode(), self._admin_token.encode()):
            return AdminPrincipal(key_id=None)
        parsed = parse_key(token)
        if parsed is not None and parsed.kind is KeyKind.ADMIN:
            async with self._sessions() as session:
                row = await AdminKeyRepository(session).get(AdminKeyId(parsed.key_id))
            if row is not None and row.revoked_at is None and self._hasher.verify(parsed.full_key, row.key_hash):
                return AdminPrincipal(key_id=AdminKeyId(row.id))
        raise ApiError(401, "The admin token is not valid.", code="unauthenticated", headers=headers)

    async def tenant_key_in_force(self, tenant_id: TenantId, key_id: ApiKeyId) -> TenantPrincipal:
        """The principal of a key that was verified earlier (a console session's), if it is still in force: not
        revoked, still the tenant's, the tenant active. Raises as `tenant` does otherwise."""
        await self._config_cache.sync()  # once per request, before any of its cached lookups
        key = await self._lookup_key(key_id)
        if key is None or key.tenant_id != tenant_id:
            raise invalid_api_key()
        if key.revoked:
            raise invalid_api_key("This API key has been revoked.")
        if await self._tenant_status(key.tenant_id) != TenantStatus.ACTIVE.value:
            raise ApiError(401, "This API key belongs to a suspended account.", code="account_suspended")
        return TenantPrincipal(tenant_id=tenant_id, key_id=key_id)

    def admin_token_fingerprint(self) -> str | None:
        """A stable digest of the bootstrap admin token (None without one): what an admin console session opened
        with the token remembers, so that changing the token ends those sessions."""
        if self._admin_token is None:
            return None
        return self._hasher.derive("console-admin-token", self._admin_token)

    async def admin_in_force(self, key_id: AdminKeyId | None, token_fingerprint: str | None) -> AdminPrincipal:
        """The admin principal of a credential verified earlier (a console session's), if it still holds: the
        admin key not revoked, or the bootstrap token unchanged."""
        refused = ApiError(401, "The admin credential is no longer valid.", code="unauthenticated")
        if key_id is None:
            current = self.admin_token_fingerprint()
            if token_fingerprint is None or current is None or not hmac.compare_digest(current, token_fingerprint):
                raise refused
            return AdminPrincipal(key_id=None)
        async with self._sessions() as session:
            row = await AdminKeyRepository(session).get(key_id)
        if row is None or row.revoked_at is not None:
            raise refused
        return AdminPrincipal(key_id=key_id)

    async def key_changed(self, key_id: ApiKeyId) -> None:
        """Publish a key's committed state (call after the commit that revoked or created it)."""
        async with self._sessions() as session:
            key = await ApiKeyRepository(session).get_for_authentication(key_id)
        if key is not None:
            await self._cache_set(f"apikey:{key_id}", _CachedKey.of(key).encode(), only_if_absent=False)

    async def tenant_changed(self, tenant_id: TenantId, status: str) -> None:
        """Publish a tenant's committed status (call after the commit that changed it)."""
        await self._cache_set(f"tenant:{tenant_id}:status", status.encode(), only_if_absent=False)

    async def _lookup_key(self, key_id: ApiKeyId) -> _CachedKey | None:
        known = self._keys.get(key_id)
        if known is not None:
            return known
        fill = self._config_cache.fill()
        entry = await self._read_key(key_id)
        if entry is not None:
            self._keys.put(key_id, entry, fill)
        return entry

    async def _read_key(self, key_id: ApiKeyId) -> _CachedKey | None:
        cached = await self._cache_get(f"apikey:{key_id}")
        if cached is not None:
            return _CachedKey.decode(cached)
        async with self._sessions() as session:
            key = await ApiKeyRepository(session).get_for_authentication(key_id)
        if key is None:
            return None
        entry = _CachedKey.of(key)
        await self._cache_set(f"apikey:{key_id}", entry.encode(), only_if_absent=True)
        await self._cache_set(f"tenant:{key.tenant_id}:status", key.tenant_status.encode(), only_if_absent=True)
        return entry

    async def _tenant_status(self, tenant_id: TenantId) -> str:
        known = self._statuses.get(tenant_id)
        if known is not None:
            return known
        fill = self._config_cache.fill()
        status = await self._read_tenant_status(tenant_id)
        self._statuses.put(tenant_id, status, fill)
        return status

    async def _read_tenant_status(self, tenant_id: TenantId) -> str:
        cached = await self._cache_get(f"tenant:{tenant_id}:status")
        if cached is not None:
            return cached.decode()
        async with self._sessions() as session:
            tenant = await TenantRepository(session).get(tenant_id)
        status = tenant.status if tenant is not None else TenantStatus.SUSPENDED.value
        await self._cache_set(f"tenant:{tenant_id}:status", status.encode(), only_if_absent=True)
        return status

    async def _cache_get(self, key: str) -> bytes | None:
        try:
            return await self._kv.get(key)
        except (RedisError, OSError):
            logger.warning("key cache unreachable; reading the database", exc_info=True)
            return None

    async def _cache_set(self, key: str, value: bytes, *, only_if_absent: bool) -> None:
        try:
            await self._kv.set(key, value, ttl_s=self._ttl_s, only_if_absent=only_if_absent)
        except (RedisError, OSError):
            logger.warning("key cache unreachable; %s not cached", key, exc_info=True)
