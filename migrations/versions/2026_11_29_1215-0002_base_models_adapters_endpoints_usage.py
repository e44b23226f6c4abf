"""base models, adapters, endpoints, usage and tenant rate limits

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:15:36
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "base_models",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("quantization", sa.String(length=16), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "quantization IS NULL OR quantization IN ('int8', 'int4')", name=op.f("ck_base_models_quantization")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_base_models")),
        sa.UniqueConstraint("name", name=op.f("uq_base_models_name")),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model_id", sa.Uuid(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("digest", sa.String(length=80), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('validating', 'ready', 'failed')", name=op.f("ck_adapters_status")),
        sa.ForeignKeyConstraint(
            ["base_model_id"],
            ["base_models.id"],
            name=op.f("fk_adapters_base_model_id_base_models"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_adapters_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("tenant_id", "name", "version", name="uq_adapters_tenant_name_version"),
    )
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_adapters_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "usage",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=True),
        sa.Column("endpoint_id", sa.Uuid(), nullable=True),
        sa.Column("adapter_id", sa.Uuid(), nullable=True),
        sa.Column("adapter_digest", sa.String(length=80), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage")),
    )
    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.create_index("ix_usage_tenant_started", ["tenant_id", "started_at"], unique=False)

    op.create_table(
        "endpoints",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base_model_id", sa.Uuid(), nullable=False),
        sa.Column("adapter_id", sa.Uuid(), nullable=True),
        sa.Column("defaults", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_endpoints_adapter_id_adapters"), ondelete="RESTRICT"
        ),
        sa.ForeignKeyConstraint(
            ["base_model_id"],
            ["base_models.id"],
            name=op.f("fk_endpoints_base_model_id_base_models"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_endpoints_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_endpoints")),
        sa.UniqueConstraint("tenant_id", "name", name="uq_endpoints_tenant_name"),
    )
    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_endpoints_tenant_id"), ["tenant_id"], unique=False)

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("requests_per_minute", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("key_requests_per_minute", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("key_tokens_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("key_tokens_per_minute")
        batch_op.drop_column("key_requests_per_minute")
        batch_op.drop_column("tokens_per_minute")
        batch_op.drop_column("requests_per_minute")

    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_endpoints_tenant_id"))

    op.drop_table("endpoints")
    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.drop_index("ix_usage_tenant_started")

    op.drop_table("usage")
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapters_tenant_id"))

    op.drop_table("adapters")
    op.drop_table("base_models")
