"""price book: versioned prices per base model

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("input_per_mtok", sa.Numeric(precision=15, scale=9), nullable=False),
        sa.Column("cached_input_per_mtok", sa.Numeric(precision=15, scale=9), nullable=False),
        sa.Column("output_per_mtok", sa.Numeric(precision=15, scale=9), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("effective_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "input_per_mtok >= 0 AND cached_input_per_mtok >= 0 AND output_per_mtok >= 0",
            name=op.f("ck_prices_non_negative"),
        ),
        sa.CheckConstraint("cached_input_per_mtok <= input_per_mtok", name=op.f("ck_prices_cached_not_above_input")),
        sa.CheckConstraint("currency = 'USD'", name=op.f("ck_prices_currency")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint("base_model", "effective_at", name="uq_prices_base_model_effective_at"),
    )


def downgrade() -> None:
    op.drop_table("prices")
