"""Usage: ``jobs.device_seconds`` (devices held times seconds, a seat counting its share of its device, added at each
lease renewal) and ``tenants.retired_device_seconds`` (those of its jobs that retention deleted).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("device_seconds", sa.Float, nullable=False, server_default="0"))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("retired_device_seconds", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("retired_device_seconds")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("device_seconds")
