"""Memory before a lease: ``devices.memory_bytes`` (what the worker said a device holds) and ``workers.model_shapes``
(the size of each model it offers), read by :mod:`tinkergym.scheduler.memory`.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("memory_bytes", sa.BigInteger, nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("model_shapes", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("model_shapes")
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("memory_bytes")
