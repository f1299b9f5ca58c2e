"""Workers, their devices, leases on jobs (epoch-fenced), device allocations and checkpoints.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("models", sa.Text, nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("last_seen_at", sa.Float, nullable=False),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("worker_id", sa.String(64), sa.ForeignKey("workers.id"), nullable=False),
        sa.Column("index", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.UniqueConstraint("worker_id", "index", name="uq_devices_worker_index"),
    )
    # Jobs that exist already have never been leased: epoch 0, no worker.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lease_epoch", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("worker_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.Float, nullable=True))
        batch.add_column(sa.Column("server_url", sa.String(500), nullable=True))
        batch.add_column(sa.Column("server_token_digest", sa.String(64), nullable=True))
        batch.create_foreign_key("fk_jobs_worker", "workers", ["worker_id"], ["id"])
    op.create_index("ix_jobs_lease", "jobs", ["state", "lease_expires_at"])
    op.create_table(
        "allocations",
        sa.Column("device_id", sa.Integer, sa.ForeignKey("devices.id"), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("granted_at", sa.Float, nullable=False),
    )
    op.create_index("ix_allocations_job", "allocations", ["job_id"])
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("job_id", "name", name="uq_checkpoints_job_name"),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
    op.drop_index("ix_allocations_job", "allocations")
    op.drop_table("allocations")
    op.drop_index("ix_jobs_lease", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("fk_jobs_worker", type_="foreignkey")
        for column in ("server_token_digest", "server_url", "lease_expires_at", "worker_id", "lease_epoch"):
            batch.drop_column(column)
    op.drop_table("devices")
    op.drop_table("workers")
