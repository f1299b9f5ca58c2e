"""Placement by measured memory: what each device's server measured at its last heartbeat (``devices.used_bytes`` and
the rest) and what a seat job really keeps per worker and model (``memory_factors``), read by :mod:`tinkergym.scheduler.memory`.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

MEASURED = ("used_bytes", "peak_bytes", "measured_total_bytes", "host_bytes", "host_peak_bytes", "base_bytes")


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        for name in MEASURED:
            batch.add_column(sa.Column(name, sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("measured_at", sa.Float, nullable=True))
    op.create_table(
        "memory_factors",
        sa.Column("worker_id", sa.String(64), sa.ForeignKey("workers.id"), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("factor", sa.Float, nullable=False),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("memory_factors")
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("measured_at")
        for name in reversed(MEASURED):
            batch.drop_column(name)
