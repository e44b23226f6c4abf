"""reasoning: a base model's reasoning settings (parser, per-tier thinking budgets), the reasoning tokens of each
usage row, and a price for them in each price version (the output price in versions made before it existed)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.add_column(sa.Column("reasoning_config", sa.JSON(), nullable=True))
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("reasoning_tokens", sa.Integer(), server_default="0", nullable=False))
    # Versions made before reasoning had a price of its own priced it as output: they keep doing so.
    with op.batch_alter_table("prices") as batch:
        batch.add_column(sa.Column("reasoning_per_mtok", sa.Numeric(precision=15, scale=9), nullable=True))
    op.execute("UPDATE prices SET reasoning_per_mtok = output_per_mtok")
    with op.batch_alter_table("prices") as batch:
        batch.alter_column("reasoning_per_mtok", existing_type=sa.Numeric(precision=15, scale=9), nullable=False)
        batch.create_check_constraint(op.f("ck_prices_reasoning_non_negative"), "reasoning_per_mtok >= 0")


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_constraint(op.f("ck_prices_reasoning_non_negative"), type_="check")
        batch.drop_column("reasoning_per_mtok")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("reasoning_tokens")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_column("reasoning_config")
