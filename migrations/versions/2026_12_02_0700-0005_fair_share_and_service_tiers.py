"""fair share and service tiers: a tenant's fairness weight, allowed tiers and concurrency cap; the tier of each
usage row and of each price version

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("fairness_weight", sa.Float(), server_default="1", nullable=False))
        batch.add_column(sa.Column("service_tiers", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("max_concurrent_requests", sa.Integer(), nullable=True))
        batch.create_check_constraint(
            op.f("ck_tenants_fairness_weight"), "fairness_weight > 0 AND fairness_weight <= 1000"
        )
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("service_tier", sa.String(length=16), server_default="default", nullable=False))
    with op.batch_alter_table("prices") as batch:
        batch.add_column(sa.Column("service_tier", sa.String(length=16), server_default="default", nullable=False))
        batch.drop_constraint("uq_prices_base_model_effective_at", type_="unique")
        batch.create_unique_constraint(
            "uq_prices_base_model_tier_effective_at", ["base_model", "service_tier", "effective_at"]
        )
        batch.create_check_constraint(op.f("ck_prices_service_tier"), "service_tier IN ('flex', 'default', 'priority')")


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_constraint(op.f("ck_prices_service_tier"), type_="check")
        batch.drop_constraint("uq_prices_base_model_tier_effective_at", type_="unique")
    # Only the default tier's versions fit the old key (one version per base model and time).
    op.execute("DELETE FROM prices WHERE service_tier <> 'default'")
    with op.batch_alter_table("prices") as batch:
        batch.create_unique_constraint("uq_prices_base_model_effective_at", ["base_model", "effective_at"])
        batch.drop_column("service_tier")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("service_tier")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint(op.f("ck_tenants_fairness_weight"), type_="check")
        batch.drop_column("max_concurrent_requests")
        batch.drop_column("service_tiers")
        batch.drop_column("fairness_weight")
