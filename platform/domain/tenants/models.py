"""The tenants table."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import JSON, CheckConstraint, Float, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow
from loraplex.platform.service_tiers import ServiceTier, canonical_tiers

MAX_FAIRNESS_WEIGHT = 1000.0  # the engine's bound too (its `fairness_weight`)


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'suspended')", name="status"),
        CheckConstraint("fairness_weight > 0 AND fairness_weight <= 1000", name="fairness_weight"),
    )

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
    # Fair share (decision 0024): the tenant's weight in the engines' VTC scheduler (2 gets twice the service of 1
    # when both are backlogged), the service tiers it may ask for (None: the platform's default), and how many of its
    # requests may run at once across the platform (None: the platform's default).
    fairness_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    service_tiers: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    max_concurrent_requests: Mapped[int | None] = mapped_column(default=None)

    def allowed_service_tiers(self, default: Sequence[ServiceTier]) -> list[ServiceTier]:
        """The tiers this tenant may ask for: its own list, else `default` (the platform's), in TIER_ORDER."""
        return canonical_tiers(self.service_tiers if self.service_tiers is not None else default)
