"""Usage: ``jobs.device_seconds`` (devices held times seconds, a seat counting its share of its device, added at each
lease renewal), ``jobs.tokens_trained``/``tokens_sampled`` and ``usage_reported`` (the last totals its server reported),
and the ``tenants.retired_*`` totals of the jobs retention deleted.

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
        batch.add_column(sa.Column("tokens_trained", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("tokens_sampled", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("usage_reported", sa.Text, nullable=True))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("retired_device_seconds", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("retired_tokens_trained", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("retired_tokens_sampled", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        for name in ("retired_tokens_sampled", "retired_tokens_trained", "retired_device_seconds"):
            batch.drop_column(name)
    with op.batch_alter_table("jobs") as batch:
        for name in ("usage_reported", "tokens_sampled", "tokens_trained", "device_seconds"):
            batch.drop_column(name)
