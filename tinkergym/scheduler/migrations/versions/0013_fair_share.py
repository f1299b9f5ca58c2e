"""Fair share: each tenant's ``share`` of the cluster (the grant order, :mod:`tinkergym.scheduler.fairshare`), and the index
that reads the head of one tenant's queue in its order (``ix_jobs_tenant_queue``), so a lease request reads a few jobs of
each tenant's queue whatever its length.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("share", sa.Float, nullable=False, server_default="1"))
    op.create_index("ix_jobs_tenant_queue", "jobs", ["tenant_id", "state", sa.text("priority DESC"), "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_queue", table_name="jobs")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("share")
