"""The responses table: what the Responses API stores of a tenant's response (`store`, on by default), so that
`previous_response_id` can continue it and GET /v1/responses/{id} return it, until its retention ends."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow


class StoredResponse(Base):
    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_...
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64), default=None)
    # The request's own input items, each with an id (GET .../input_items), and the response object as answered.
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The response's status (its JSON's too): background ones are queued, then in_progress, then end (their runs
    # are jobs: platform/jobs).
    status: Mapped[str] = mapped_column(String(16), default="completed")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)
