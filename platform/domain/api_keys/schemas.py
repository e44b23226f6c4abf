"""API key shapes at the edge: `{id, prefix, name, created_at, revoked_at}`; creation adds `key`, shown once."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from loraplex.platform.domain.api_keys.keys import KeyKind, NewKey, key_prefix
from loraplex.platform.domain.api_keys.models import AdminKey, ApiKey
from loraplex.platform.schemas import Name, RequestBody


class ApiKeyOut(BaseModel):
    id: str
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, key: ApiKey) -> ApiKeyOut:
        return cls(
            id=key.id,
            prefix=key_prefix(KeyKind.TENANT, key.id),
            name=key.name,
            created_at=key.created_at,
            revoked_at=key.revoked_at,
        )


class ApiKeyCreated(ApiKeyOut):
    key: str

    @classmethod
    def created(cls, key: ApiKey | AdminKey, new_key: NewKey) -> ApiKeyCreated:
        return cls(
            id=key.id,
            prefix=new_key.prefix,
            name=key.name,
            created_at=key.created_at,
            revoked_at=key.revoked_at,
            key=new_key.full_key,
        )


class ApiKeyCreate(RequestBody):
    name: Name | None = None
