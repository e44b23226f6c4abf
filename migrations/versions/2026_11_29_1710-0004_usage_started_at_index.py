"""usage: an index on started_at alone, for billing reports across tenants over a time range

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 17:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # ix_usage_tenant_started serves one tenant's range; a report over every tenant filters on started_at alone.
    op.create_index("ix_usage_started_at", "usage", ["started_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_usage_started_at", table_name="usage")
