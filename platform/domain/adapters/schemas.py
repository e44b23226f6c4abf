"""Adapter shapes at the edge: `{id, object, name, version, base_model, status, error, digest, draft_digest, rank,
size_bytes, created_at}`, and the text fields of an upload."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, StringConstraints

from loraplex.platform.domain.adapters.models import Adapter, AdapterStatus
from loraplex.platform.schemas import Name, RequestBody

# Like endpoint names: adapter names end up in logs, metrics labels and engine adapter names.
AdapterName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"),
]


class AdapterUploadFields(RequestBody):
    """The text fields of `POST /v1/adapters` (multipart/form-data); the files come as file parts beside them."""

    name: AdapterName
    base_model: Name


class AdapterOut(BaseModel):
    id: uuid.UUID
    object: Literal["adapter"] = "adapter"
    name: str
    version: int
    base_model: str
    status: AdapterStatus
    error: str | None
    digest: str | None  # "sha256:<hex>" over both files (engine.lora.adapter_digest)
    draft_digest: str | None  # the same over the draft counterpart's two files (draft/); null: it has none
    rank: int | None  # the largest rank of any adapted module
    size_bytes: int | None  # length of adapter_model.safetensors
    created_at: datetime

    @classmethod
    def of(cls, row: Adapter, base_model: str) -> AdapterOut:
        return cls(
            id=row.id,
            name=row.name,
            version=row.version,
            base_model=base_model,
            status=AdapterStatus(row.status),
            error=row.error,
            digest=row.digest,
            draft_digest=row.draft_digest,
            rank=row.rank,
            size_bytes=row.size_bytes,
            created_at=row.created_at,
        )


class AdapterDeleted(BaseModel):
    id: uuid.UUID
    object: Literal["adapter"] = "adapter"
    deleted: bool = True
