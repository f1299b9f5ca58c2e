"""``jobs.placed`` goes: a LoRA job resumes on a seat of a shared server or on a whole device, whichever wrote its
checkpoints (both load each other's states: :mod:`tinkergym.backends.torch.lora_states`).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("placed")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("placed", sa.String(8), nullable=True))
