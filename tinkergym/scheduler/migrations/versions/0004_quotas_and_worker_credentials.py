"""Quotas on everything a tenant can grow, worker credentials made by the operator, quarantine of rogue workers.

- ``tenants``: ``max_artifact_bytes`` (bytes its jobs' artifacts may hold), ``max_events_per_job``,
  ``max_event_bytes`` (one event's data, as JSON) and ``keep_ended_jobs`` (ended jobs kept; older ones are deleted
  with their events, checkpoints and artifacts);
- ``jobs.artifact_bytes``: the bytes the job's stored artifacts hold (0 for existing jobs: their files were
  stored before the quota; the retention pass counts them again);
- ``api_keys.worker_bounds``: a worker credential's bounds (JSON: devices, kind, models, tenants), set only by
  ``tinkergym scheduler workers create``;
- ``workers.strikes`` and ``workers.quarantined_at``: leases that expired before the job's server came up, in a
  row, and when the worker was quarantined for them;
- indexes for the retention pass: ended jobs by age, idempotency records by age.

Keys lose the ``worker`` scope here: a tenant's key (``admin`` or ``worker``) no longer registers workers or takes
leases. Each such key is named in a warning; a key left with no scope is revoked. Make worker credentials with
``tinkergym scheduler workers create`` and restart the workers with them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_artifact_bytes", sa.BigInteger, nullable=False, server_default=str(100 << 30)))
        batch.add_column(sa.Column("max_events_per_job", sa.Integer, nullable=False, server_default="100000"))
        batch.add_column(sa.Column("max_event_bytes", sa.Integer, nullable=False, server_default="65536"))
        batch.add_column(sa.Column("keep_ended_jobs", sa.Integer, nullable=False, server_default="1000"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("artifact_bytes", sa.BigInteger, nullable=False, server_default="0"))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("worker_bounds", sa.Text, nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("strikes", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("quarantined_at", sa.Float, nullable=True))
    op.create_index("ix_jobs_state_finished", "jobs", ["state", "finished_at"])
    op.create_index("ix_idempotency_created", "idempotency", ["created_at"])
    _drop_worker_scope()


def _drop_worker_scope() -> None:
    """Tenants' keys with the ``worker`` or ``admin`` scope no longer act as workers: say which, revoke those left with nothing."""
    conn = op.get_bind()
    keys = sa.table("api_keys", sa.column("id"), sa.column("tenant_id"), sa.column("scopes"), sa.column("revoked_at"))
    rows = conn.execute(sa.select(keys.c.id, keys.c.tenant_id, keys.c.scopes).where(keys.c.revoked_at.is_(None))).all()
    for key_id, tenant_id, scopes in rows:
        held = [s for s in scopes.split(",") if s]
        if "worker" not in held and "admin" not in held:
            continue
        kept = [s for s in held if s != "worker"]
        if "worker" in held:
            values: dict = {"scopes": ",".join(kept)}
            if not kept:
                values["revoked_at"] = time.time()
            conn.execute(sa.update(keys).where(keys.c.id == key_id).values(**values))
        log.warning(
            "key %s (tenant %s) no longer registers workers or takes leases%s: worker credentials are made with "
            "`tinkergym scheduler workers create`", key_id, tenant_id, " and is revoked (it had no other scope)" if not kept else "",
        )


def downgrade() -> None:
    op.drop_index("ix_idempotency_created", "idempotency")
    op.drop_index("ix_jobs_state_finished", "jobs")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("quarantined_at")
        batch.drop_column("strikes")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("worker_bounds")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("artifact_bytes")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("keep_ended_jobs")
        batch.drop_column("max_event_bytes")
        batch.drop_column("max_events_per_job")
        batch.drop_column("max_artifact_bytes")
