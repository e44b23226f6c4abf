"""The endpoints table."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow


class Endpoint(Base):
    __tablename__ = "endpoints"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_endpoints_tenant_name"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))  # what the tenant sends as `model`
    base_model_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("base_models.id", ondelete="RESTRICT"))
    # RESTRICT: an adapter an endpoint serves cannot be deleted (the API answers 409 first).
    adapter_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("adapters.id", ondelete="RESTRICT"), default=None)
    defaults: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # sampling defaults of this endpoint
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
