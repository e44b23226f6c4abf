"""The shape of API keys, and how they are hashed and checked.

A tenant key reads `lpx_<id>_<secret>`, an admin key `lpxadm_<id>_<secret>`. The id is public (it is the row's
primary key, shown in lists); the secret is 32 base62 characters (about 190 bits). The database stores only
HMAC-SHA256(secret_key, whole key), so a leaked table cannot be replayed and cannot be brute-forced without the
deployment's secret key; checks compare digests in constant time.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

_ID_ALPHABET = string.ascii_lowercase + string.digits
_SECRET_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 16
SECRET_LENGTH = 32
MAX_KEY_LENGTH = 128


class KeyKind(enum.StrEnum):
    TENANT = "lpx"
    ADMIN = "lpxadm"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    kind: KeyKind
    key_id: str
    full_key: str


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly minted key: `full_key` is shown to its owner once and never stored."""

    kind: KeyKind
    key_id: str
    full_key: str

    @property
    def prefix(self) -> str:
        return f"{self.kind.value}_{self.key_id}"


def generate_key(kind: KeyKind) -> NewKey:
    key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(ID_LENGTH))
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(SECRET_LENGTH))
    return NewKey(kind=kind, key_id=key_id, full_key=f"{kind.value}_{key_id}_{secret}")


def key_prefix(kind: KeyKind, key_id: str) -> str:
    return f"{kind.value}_{key_id}"


def parse_key(text: str) -> ParsedKey | None:
    """Split a presented key into its parts; None when it does not have the shape of one of our keys."""
    if len(text) > MAX_KEY_LENGTH:
        return None
    parts = text.split("_")
    if len(parts) != 3:
        return None
    kind_text, key_id, secret = parts
    try:
        kind = KeyKind(kind_text)
    except ValueError:
        return None
    if len(key_id) != ID_LENGTH or any(c not in _ID_ALPHABET for c in key_id):
        return None
    if len(secret) != SECRET_LENGTH or any(c not in _SECRET_ALPHABET for c in secret):
        return None
    return ParsedKey(kind=kind, key_id=key_id, full_key=text)


class KeyHasher:
    """Keyed hashing of API keys. One instance per process, built from the deployment's secret key."""

    def __init__(self, secret_key: bytes) -> None:
        if len(secret_key) < 16:
            raise ValueError("the secret key must be at least 16 bytes")
        self._secret_key = secret_key

    def hash(self, full_key: str) -> str:
        return hmac.new(self._secret_key, full_key.encode(), hashlib.sha256).hexdigest()

    def verify(self, full_key: str, stored_hash: str) -> bool:
        return hmac.compare_digest(self.hash(full_key), stored_hash)

    def derive(self, purpose: str, value: str) -> str:
        """A secret of its own for `value` (a tenant id, say), derived from the deployment's secret key: stable,
        different for every value and purpose, and unguessable without the key."""
        return hmac.new(self._secret_key, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()
