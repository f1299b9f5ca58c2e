"""An index on jobs (tenant_id, state): a tenant's queued-job quota and state filters without scanning its history.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_tenant_state", "jobs", ["tenant_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_state", "jobs")
