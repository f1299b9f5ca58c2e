"""A worker's lost leases in a window: ``workers.losses`` and ``workers.losses_since``
(:func:`tinkergym.scheduler.worker_registry._count_loss`).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("losses", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("losses_since", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("losses_since")
        batch.drop_column("losses")
