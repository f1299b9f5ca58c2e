"""Seats on shared training servers: ``devices.seat_of`` (the device a seat sits on) and ``devices.shared`` (the
server's base, JSON), both null for a whole device (:mod:`tinkergym.scheduler.seats`); ``jobs.placed``, the kind of
place its checkpoints were written on.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("seat_of", sa.Integer, nullable=True))
        batch.add_column(sa.Column("shared", sa.Text, nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("placed", sa.String(8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("placed")
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("shared")
        batch.drop_column("seat_of")
