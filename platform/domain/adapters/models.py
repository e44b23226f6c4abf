"""The adapters table: one row per uploaded version."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow


class AdapterStatus(enum.StrEnum):
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "version", name="uq_adapters_tenant_name_version"),
        CheckConstraint("status IN ('validating', 'ready', 'failed')", name="status"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(default=1)  # uploading again under a name adds a version
    base_model_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("base_models.id", ondelete="RESTRICT"))
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.VALIDATING.value)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    digest: Mapped[str | None] = mapped_column(String(80), default=None)  # "sha256:<hex>" of both files
    # "sha256:<hex>" of the draft counterpart's two files (under draft/); null: the adapter has none.
    draft_digest: Mapped[str | None] = mapped_column(String(80), default=None)
    rank: Mapped[int | None] = mapped_column(default=None)  # the largest rank of any module
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
