"""Console sessions: what signing in leaves on the server, looked up by the cookie's opaque id.

The cookie holds 32 random bytes (urlsafe base64) and nothing else. The store keeps each session under the SHA-256
of that id, so a copy of Redis (or a log of its keys) holds nothing a browser could present. Sessions live in the
platform's key-value store (Redis, shared by every replica; the in-process store in embedded mode) with an absolute
expiry; signing out deletes the entry. A session names the credential it was opened with (the tenant's API key,
an admin key, or the fingerprint of the bootstrap admin token), and every request checks that credential again
(access.py), so revoking the key, suspending the tenant or changing the admin token ends the session at once.
"""

from __future__ import annotations

import enum
import hashlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass

from loraplex.platform.ids import AdminKeyId, ApiKeyId, TenantId
from loraplex.platform.kv import KeyValueStore

SESSION_ID_BYTES = 32
CSRF_TOKEN_BYTES = 32
_KEY_PREFIX = "console:session:"


class SessionKind(enum.StrEnum):
    TENANT = "tenant"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """One signed-in browser. `tenant_id`/`api_key_id` for a tenant; `admin_key_id` or `admin_token_fingerprint`
    (which of the two admin credentials) for an admin."""

    kind: SessionKind
    csrf_token: str
    created_at: float  # unix seconds
    expires_at: float  # unix seconds
    tenant_id: TenantId | None = None
    api_key_id: ApiKeyId | None = None
    admin_key_id: AdminKeyId | None = None
    admin_token_fingerprint: str | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "kind": self.kind.value,
                "csrf_token": self.csrf_token,
                "created_at": self.created_at,
                "expires_at": self.expires_at,
                "tenant_id": None if self.tenant_id is None else str(self.tenant_id),
                "api_key_id": self.api_key_id,
                "admin_key_id": self.admin_key_id,
                "admin_token_fingerprint": self.admin_token_fingerprint,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ConsoleSession:
        entry = json.loads(raw)
        return cls(
            kind=SessionKind(entry["kind"]),
            csrf_token=entry["csrf_token"],
            created_at=float(entry["created_at"]),
            expires_at=float(entry["expires_at"]),
            tenant_id=None if entry["tenant_id"] is None else TenantId(uuid.UUID(entry["tenant_id"])),
            api_key_id=None if entry["api_key_id"] is None else ApiKeyId(entry["api_key_id"]),
            admin_key_id=None if entry["admin_key_id"] is None else AdminKeyId(entry["admin_key_id"]),
            admin_token_fingerprint=entry["admin_token_fingerprint"],
        )


def _store_key(session_id: str) -> str:
    return _KEY_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()


def new_token(num_bytes: int = CSRF_TOKEN_BYTES) -> str:
    return secrets.token_urlsafe(num_bytes)


class SessionStore:
    """Creates, finds and ends console sessions. Stateless itself: every session is in `kv`."""

    def __init__(self, kv: KeyValueStore, *, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("the session lifetime must be positive")
        self._kv = kv
        self._ttl_s = ttl_s

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    async def open(
        self,
        kind: SessionKind,
        *,
        tenant_id: TenantId | None = None,
        api_key_id: ApiKeyId | None = None,
        admin_key_id: AdminKeyId | None = None,
        admin_token_fingerprint: str | None = None,
    ) -> tuple[str, ConsoleSession]:
        """A new session and the id its cookie carries (returned here only; the store keeps its hash)."""
        if kind is SessionKind.TENANT and (tenant_id is None or api_key_id is None):
            raise ValueError("a tenant session needs the tenant and the key it was opened with")
        if kind is SessionKind.ADMIN and (admin_key_id is None) == (admin_token_fingerprint is None):
            raise ValueError("an admin session needs exactly one of an admin key and the admin token's fingerprint")
        now = time.time()
        session = ConsoleSession(
            kind=kind,
            csrf_token=new_token(),
            created_at=now,
            expires_at=now + self._ttl_s,
            tenant_id=tenant_id,
            api_key_id=api_key_id,
            admin_key_id=admin_key_id,
            admin_token_fingerprint=admin_token_fingerprint,
        )
        session_id = new_token(SESSION_ID_BYTES)
        await self._kv.set(_store_key(session_id), session.encode(), ttl_s=self._ttl_s)
        return session_id, session

    async def get(self, session_id: str) -> ConsoleSession | None:
        """The live session with this id, or None (unknown, ended, expired or malformed)."""
        if not session_id or len(session_id) > 128:
            return None
        raw = await self._kv.get(_store_key(session_id))
        if raw is None:
            return None
        try:
            session = ConsoleSession.decode(raw)
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires_at <= time.time():
            return None
        return session

    async def end(self, session_id: str) -> None:
        if session_id and len(session_id) <= 128:
            await self._kv.delete(_store_key(session_id))
