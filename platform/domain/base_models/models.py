"""The base_models table."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, CheckConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.engine import ReasoningConfig, SpeculativeConfig
from loraplex.platform.db.base import Base, utcnow


class Quantization(enum.StrEnum):
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"


class BaseModel(Base):
    __tablename__ = "base_models"
    __table_args__ = (
        CheckConstraint("quantization IS NULL OR quantization IN ('int8', 'int4', 'fp8')", name="quantization"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    # What `model` names in completions and what engines announce they serve.
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(1024))  # a local folder or an s3:// URI of the checkpoint
    quantization: Mapped[str | None] = mapped_column(String(16), default=None)
    # How engines serving it speculate (vLLM's --speculative-config object, every field spelled out: see
    # speculative_config_json); null: they do not. Set through `set_speculative`, from a parsed config.
    speculative_config: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # How engines serving it read and bound a think block (ReasoningConfig.to_dict, every field spelled out); null:
    # the model is not served as a reasoning model. Set through `set_reasoning`, from a validated config.
    reasoning_config: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    status: Mapped[str] = mapped_column(String(16), default="ready")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        self.speculative_config = speculative_config_json(config)

    def set_reasoning(self, config: ReasoningConfig | None) -> None:
        self.reasoning_config = None if config is None else config.to_dict()

    def reasoning(self) -> ReasoningConfig | None:
        """The stored reasoning settings, parsed; ValueError if the engine no longer takes them (they were valid when
        stored: only a stricter engine release could make them fail)."""
        return None if self.reasoning_config is None else ReasoningConfig.from_dict(self.reasoning_config)


def speculative_config_json(config: SpeculativeConfig | None) -> dict[str, Any] | None:
    """`config` as the JSON object `SpeculativeConfig.parse` reads back to an equal config: every field given, so a
    stored row does not change meaning if the engine's defaults do."""
    if config is None:
        return None
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    return {name: str(value) if isinstance(value, Path) else value for name, value in values.items()}
