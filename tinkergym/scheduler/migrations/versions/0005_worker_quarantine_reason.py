"""Why a worker is quarantined: ``workers.quarantine_reason`` (its strikes, or the fault it reported when it gave a job
back because it could not run it: a package, a model's files or a device missing on its machine).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("quarantine_reason", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("quarantine_reason")
