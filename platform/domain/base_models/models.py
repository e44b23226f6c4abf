"""The base_models table."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow


class Quantization(enum.StrEnum):
    INT8 = "int8"
    INT4 = "int4"


class BaseModel(Base):
    __tablename__ = "base_models"
    __table_args__ = (CheckConstraint("quantization IS NULL OR quantization IN ('int8', 'int4')", name="quantization"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    # What `model` names in completions and what engines announce they serve.
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(1024))  # a local folder or an s3:// URI of the checkpoint
    quantization: Mapped[str | None] = mapped_column(String(16), default=None)
    status: Mapped[str] = mapped_column(String(16), default="ready")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
