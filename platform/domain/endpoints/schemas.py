"""Endpoint shapes at the edge: `{id, name, base_model, adapter_id, defaults, status, created_at}`."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from loraplex.platform.schemas import Name, RequestBody, from_json_string

EndpointName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"),
]


class EndpointDefaults(RequestBody):
    """Sampling defaults a request to the endpoint gets unless it sets them itself."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stop: list[Annotated[str, StringConstraints(min_length=1)]] | None = Field(default=None, max_length=4)
    seed: int | None = None


class EndpointCreate(RequestBody):
    name: EndpointName
    base_model: Name
    adapter_id: Annotated[uuid.UUID, from_json_string(uuid.UUID)] | None = None
    defaults: EndpointDefaults = Field(default_factory=EndpointDefaults)


class EndpointOut(BaseModel):
    id: uuid.UUID
    object: Literal["endpoint"] = "endpoint"
    name: str
    base_model: str
    adapter_id: uuid.UUID | None
    defaults: dict[str, Any]
    status: str
    created_at: datetime


class EndpointDeleted(BaseModel):
    id: uuid.UUID
    object: Literal["endpoint"] = "endpoint"
    deleted: bool = True
