"""The prices table: the price book, one row per (base model, version)."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import CheckConstraint, Numeric, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, utcnow

# USD per million tokens: at most 6 integer and 9 fractional digits. 15 significant digits also survive SQLite,
# which stores NUMERIC as a double (the embedded mode); Postgres stores them exactly.
PRICE_PRECISION = 15
PRICE_SCALE = 9


def _price() -> Numeric[Decimal]:
    return Numeric(PRICE_PRECISION, PRICE_SCALE, asdecimal=True)


def _output_price(context: Any) -> Any:
    """The reasoning price of a version given none: its output price (reasoning tokens are output tokens)."""
    return context.get_current_parameters()["output_per_mtok"]


class PriceVersion(Base):
    """One version of a base model's prices. Versions are never updated or deleted: a change is a new row, in force
    from its `effective_at` until the next version's. Each usage row is rated with the version in force when its
    request started."""

    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint("base_model", "service_tier", "effective_at", name="uq_prices_base_model_tier_effective_at"),
        CheckConstraint(
            "input_per_mtok >= 0 AND cached_input_per_mtok >= 0 AND output_per_mtok >= 0", name="non_negative"
        ),
        CheckConstraint("cached_input_per_mtok <= input_per_mtok", name="cached_not_above_input"),
        CheckConstraint("reasoning_per_mtok >= 0", name="reasoning_non_negative"),
        CheckConstraint("currency = 'USD'", name="currency"),
        CheckConstraint("service_tier IN ('flex', 'default', 'priority')", name="service_tier"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    # The base model's name, as usage rows carry it; not a foreign key, since prices outlive a base model's row.
    base_model: Mapped[str] = mapped_column(String(200))
    # The service tier these prices are for (OpenAI's service_tier); a tier with no version of its own is rated by
    # the default tier's.
    service_tier: Mapped[str] = mapped_column(String(16), default="default", server_default="default")
    input_per_mtok: Mapped[Decimal] = mapped_column(_price())  # prompt tokens not served from the prefix cache
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(_price())  # prompt tokens served from the prefix cache
    output_per_mtok: Mapped[Decimal] = mapped_column(_price())  # completion tokens outside a think block
    # Completion tokens inside one; not set: the output price (`_output_price`), as in versions made before it.
    reasoning_per_mtok: Mapped[Decimal] = mapped_column(_price(), default=_output_price)
    currency: Mapped[str] = mapped_column(String(3), default="USD")
    effective_at: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
