"""Base model shapes at the edge: `{name, source, quantization, status}`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel as Schema
from pydantic import StringConstraints, field_validator

from loraplex.platform.domain.base_models.models import BaseModel, Quantization
from loraplex.platform.schemas import Name, Printable, RequestBody, from_json_string

ModelName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"),
]


class BaseModelOut(Schema):
    name: str
    source: str
    quantization: Quantization | None
    status: str
    created_at: datetime

    @classmethod
    def of(cls, row: BaseModel) -> BaseModelOut:
        return cls(
            name=row.name,
            source=row.source,
            quantization=Quantization(row.quantization) if row.quantization else None,
            status=row.status,
            created_at=row.created_at,
        )


class BaseModelCreate(RequestBody):
    name: ModelName
    source: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=1024), Printable]
    quantization: Annotated[Quantization, from_json_string(Quantization)] | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if "://" in value and not value.startswith("s3://"):
            raise ValueError("must be a local folder or an s3:// URI")
        return value


__all__ = ["BaseModelCreate", "BaseModelOut", "ModelName", "Name"]
