"""base model speculative config: how engines serving a base model speculate (vLLM's --speculative-config object)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.add_column(sa.Column("speculative_config", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.drop_column("speculative_config")
