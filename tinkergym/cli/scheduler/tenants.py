"""``tinkergym scheduler tenants``: the tenants and their quotas; the check of a tenant's name every command that takes
one makes."""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.common import FiniteFloat, shorten, table, when
from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database

GIB = 1 << 30
#: :data:`tinkergym.scheduler.db.MAX_INT` (the largest integer a quota column holds), without importing SQLAlchemy here.
MAX_INT = 2**31 - 1


def check_tenant(tenant: str) -> str:
    """``tenant`` (a ``--tenant``) when it is a tenant's name; else a usage error that says what a name may hold."""
    from tinkergym.scheduler.auth import TENANT_PATTERN

    if not TENANT_PATTERN.match(tenant):
        raise click.BadParameter(
            f"{shorten(tenant, 80)!r} is not a tenant name: use lowercase letters, digits, '.', '_' and '-' "
            "(start with a letter or digit, at most 64)", param_hint="--tenant")
    return tenant


@click.group("tenants")
def tenants_group() -> None:
    """Tenants and their quotas (GPUs held at once, jobs queued at once, stored artifacts, events, ended jobs kept).

    \b
    Examples:
      tinkergym scheduler tenants set acme --max-gpus 4 --max-queued 50
      tinkergym scheduler tenants set acme --max-artifact-gb 500 --max-events-per-job 200000 --keep-ended-jobs 5000
      tinkergym scheduler tenants list
    """


@tenants_group.command("set")
@click.argument("tenant")
@click.option("--max-gpus", type=click.IntRange(min=0), default=None, help="GPUs the tenant's jobs may hold at once (new tenants: 8).")
@click.option("--max-queued", type=click.IntRange(min=0), default=None, help="Jobs the tenant may have queued at once (new tenants: 100).")
@click.option("--max-artifact-gb", type=FiniteFloat(min=0, max=(2**63 - 1) // GIB), default=None, metavar="GIB",
              help="Artifact bytes (checkpoints) the tenant's jobs may store in all, in GiB (2**30 bytes; fractions allowed); "
                   "an upload past it is refused (413). New tenants: 100.")
@click.option("--max-events-per-job", type=click.IntRange(0, MAX_INT), default=None, metavar="N",
              help="Events one job may hold; a client's or worker's event past it is refused (429). New tenants: 100000.")
@click.option("--max-event-kb", type=click.IntRange(1, MAX_INT // 1024), default=None, metavar="KIB",
              help="One event's data, as JSON, in KiB (1024 bytes); a larger one is refused (413). New tenants: 64.")
@click.option("--keep-ended-jobs", type=click.IntRange(0, MAX_INT), default=None, metavar="N",
              help="Ended jobs kept; older ones are deleted with their events and artifacts (see serve --job-retention). "
                   "New tenants: 1000.")
@click.option("--max-idempotency-records", type=click.IntRange(0, MAX_INT), default=None, metavar="N",
              help="Idempotency-Key records (stored answers, kept --idempotency-ttl) the tenant may hold at once; a new key "
                   "past it is refused (429 with Retry-After). New tenants: 10000.")
@click.option("--max-idempotency-mb", type=click.IntRange(0, MAX_INT // 2**20), default=None, metavar="MIB",
              help="Bytes those records may hold, in MiB (2**20 bytes); a new key past it is refused (429). New tenants: 64.")
@click.option("--share", type=FiniteFloat(min=0.01, max=1e6), default=None, metavar="W",
              help="Its share of the cluster while other tenants have work too: free devices go to the tenant holding the least "
                   "for its share, so a share of 2 gets twice what 1 gets (fair share). New tenants: 1.")
@db_option
@data_dir_option
def tenants_set(
    tenant: str, max_gpus: int | None, max_queued: int | None, max_artifact_gb: float | None, max_events_per_job: int | None,
    max_event_kb: int | None, keep_ended_jobs: int | None, max_idempotency_records: int | None, max_idempotency_mb: int | None,
    share: float | None, db: str | None, data_dir: Path,
) -> None:
    """Create a tenant or change its quotas (the options not given keep their values).

    \b
    Example:
      tinkergym scheduler tenants set acme --max-gpus 4 --max-queued 50
      tinkergym scheduler tenants set acme --max-artifact-gb 0.5 --max-event-kb 128
      tinkergym scheduler tenants set research --share 2
    """
    from sqlalchemy import select

    from tinkergym.scheduler.auth import ensure_tenant
    from tinkergym.scheduler.db import tenants as tenants_table

    check_tenant(tenant)
    engine = open_database(db, data_dir)
    try:
        with engine.begin() as conn:
            ensure_tenant(conn, tenant, max_gpus=max_gpus, max_queued=max_queued,
                          max_artifact_bytes=None if max_artifact_gb is None else round(max_artifact_gb * GIB),
                          max_events_per_job=max_events_per_job, max_event_bytes=None if max_event_kb is None else max_event_kb * 1024,
                          keep_ended_jobs=keep_ended_jobs, max_idempotency_records=max_idempotency_records,
                          max_idempotency_bytes=None if max_idempotency_mb is None else max_idempotency_mb << 20, share=share)
            row = conn.execute(select(tenants_table).where(tenants_table.c.id == tenant)).mappings().one()
    finally:
        engine.dispose()
    click.echo(f"tenant {row['id']}: max_gpus={row['max_gpus']} max_queued={row['max_queued']} "
               f"max_artifact_gb={_gib(row['max_artifact_bytes'])} max_events_per_job={row['max_events_per_job']} "
               f"max_event_kb={_kib(row['max_event_bytes'])} keep_ended_jobs={row['keep_ended_jobs']} "
               f"max_idempotency_records={row['max_idempotency_records']} max_idempotency_mb={row['max_idempotency_bytes'] >> 20} "
               f"share={row['share']:g}")


def _gib(n: int) -> str:
    """Bytes as GiB, as ``--max-artifact-gb`` takes them (3 decimals, or 3 significant digits below 0.001)."""
    text = f"{n / GIB:.3f}".rstrip("0").rstrip(".")
    return f"{n / GIB:.3g}" if text == "0" and n else text


def _kib(n: int) -> str:
    return f"{n / 1024:.3f}".rstrip("0").rstrip(".")


@tenants_group.command("list")
@db_option
@data_dir_option
def tenants_list(db: str | None, data_dir: Path) -> None:
    """List tenants, their quotas and the artifact bytes they store (STORED_GB).

    \b
    Example:
      tinkergym scheduler tenants list --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
    """
    from sqlalchemy import func, select

    from tinkergym.scheduler.bounds import CLUSTER  # the worker credentials' tenant: no jobs, not listed

    from tinkergym.scheduler.db import jobs as jobs_table
    from tinkergym.scheduler.db import tenants as tenants_table

    engine = open_database(db, data_dir)
    try:
        with engine.connect() as conn:
            found = list(conn.execute(select(tenants_table).where(tenants_table.c.id != CLUSTER).order_by(tenants_table.c.id)).mappings())
            stored = dict(conn.execute(select(jobs_table.c.tenant_id, func.sum(jobs_table.c.artifact_bytes)).group_by(jobs_table.c.tenant_id)).all())
    finally:
        engine.dispose()
    rows = [(t["id"], str(t["max_gpus"]), str(t["max_queued"]), _gib(t["max_artifact_bytes"]), _gib(int(stored.get(t["id"]) or 0)),
             str(t["max_events_per_job"]), _kib(t["max_event_bytes"]), str(t["keep_ended_jobs"]), f"{t['share']:g}", when(t["created_at"]))
            for t in found]
    header = ("TENANT", "MAX_GPUS", "MAX_QUEUED", "MAX_ARTIFACT_GB", "STORED_GB", "MAX_EVENTS_PER_JOB", "MAX_EVENT_KB", "KEEP_ENDED_JOBS", "SHARE",
              "CREATED")
    click.echo(table(header, rows) if rows else "no tenants")
