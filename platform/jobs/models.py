"""The jobs table: one row per unit of durable work, with the lease of the replica running it."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
ENDED = (SUCCEEDED, FAILED, CANCELLED)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_run_after", "status", "run_after"),)

    # The id of what the job makes (a response's resp_..., a fine-tuning job's ftjob-...): one job per object.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))  # which handler runs it
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default=QUEUED)
    attempts: Mapped[int] = mapped_column(default=0)  # claims so far, the one running included
    max_attempts: Mapped[int] = mapped_column(default=3)
    claimed_by: Mapped[str | None] = mapped_column(String(128), default=None)  # the worker holding the lease
    lease_until: Mapped[datetime | None] = mapped_column(default=None)  # past it, another worker may claim it
    run_after: Mapped[datetime] = mapped_column(default=utcnow)  # a job put back waits until then
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
