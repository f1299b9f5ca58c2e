"""Bounds on a tenant's Idempotency-Key records: ``tenants.max_idempotency_records`` and ``tenants.max_idempotency_bytes``
(:mod:`tinkergym.scheduler.idempotency`); existing tenants get the defaults.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_idempotency_records", sa.Integer, nullable=False, server_default="10000"))
        batch.add_column(sa.Column("max_idempotency_bytes", sa.BigInteger, nullable=False, server_default=str(64 << 20)))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_idempotency_bytes")
        batch.drop_column("max_idempotency_records")
