"""fp8: a base model may be registered as quantized to FP8 at load (issue 35), beside int8 and int4

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 00:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.drop_constraint(op.f("ck_base_models_quantization"), type_="check")
        batch.create_check_constraint(
            op.f("ck_base_models_quantization"), "quantization IS NULL OR quantization IN ('int8', 'int4', 'fp8')"
        )


def downgrade() -> None:
    op.execute("UPDATE base_models SET quantization = NULL WHERE quantization = 'fp8'")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_constraint(op.f("ck_base_models_quantization"), type_="check")
        batch.create_check_constraint(
            op.f("ck_base_models_quantization"), "quantization IS NULL OR quantization IN ('int8', 'int4')"
        )
