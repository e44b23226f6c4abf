"""The usage table: one row per request, keyed by the request id so a retry or replay never counts twice."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base


class UsageRecord(Base):
    __tablename__ = "usage"
    __table_args__ = (
        Index("ix_usage_tenant_started", "tenant_id", "started_at"),  # a tenant's usage over a range (/v1/usage)
        Index("ix_usage_started_at", "started_at"),  # every tenant's over a range (admin billing reports)
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[str | None] = mapped_column(String(32), default=None)
    # Plain columns, not foreign keys: usage outlives the endpoints and adapter versions it names.
    endpoint_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    adapter_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    adapter_digest: Mapped[str | None] = mapped_column(String(80), default=None)
    model: Mapped[str] = mapped_column(String(200))  # what the client sent as `model`
    base_model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    # The completion tokens spent inside a think block (part of completion_tokens, as OpenAI counts them).
    reasoning_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    status: Mapped[str] = mapped_column(String(16))  # ok | length | error | cancelled
    service_tier: Mapped[str] = mapped_column(String(16), default="default", server_default="default")
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime]
