"""The tenants table."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("status IN ('active', 'suspended')", name="status"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.ACTIVE.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    # Rate limits set by an admin (None: the platform's defaults); per tenant, and per API key of the tenant.
    requests_per_minute: Mapped[int | None] = mapped_column(default=None)
    tokens_per_minute: Mapped[int | None] = mapped_column(default=None)
    key_requests_per_minute: Mapped[int | None] = mapped_column(default=None)
    key_tokens_per_minute: Mapped[int | None] = mapped_column(default=None)
