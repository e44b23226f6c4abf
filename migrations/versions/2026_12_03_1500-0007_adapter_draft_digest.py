"""adapter draft digest: the content digest of an adapter's draft counterpart (its draft/ files), null without one

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("draft_digest", sa.String(length=80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("draft_digest")
