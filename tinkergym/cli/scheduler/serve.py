"""``tinkergym scheduler``: serve the job scheduler, make and revoke its API keys, set tenant quotas, make worker
credentials and list its workers (:mod:`tinkergym.cli.scheduler.workers`), migrate its database.

Keys are made here, on the scheduler's machine, and nowhere else: the service has no registration route.
SQLAlchemy, Alembic and FastAPI are imported inside the commands, so ``import tinkergym.cli`` stays light.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

from tinkergym.cli.common import FiniteFloat, InputError, SafePath, shorten, table
from tinkergym.cli.connection_options import connection_limits, connection_options, is_loopback
from tinkergym.plumbing.folders import keep_private

DB_ENVVAR = "TINKERGYM_SCHEDULER_DB"
GIB = 1 << 30
#: :data:`tinkergym.scheduler.db.MAX_INT` (the largest integer a quota column holds), without importing SQLAlchemy here.
MAX_INT = 2**31 - 1
DEFAULT_DATA_DIR = Path("scheduler-data")

db_option = click.option(
    "--db", "db", default=None, envvar=DB_ENVVAR, show_envvar=True, metavar="URL",
    help="SQLAlchemy URL: sqlite:///path/scheduler.db or postgresql://user@host:5432/name (default: <data-dir>/scheduler.db).",
)
data_dir_option = click.option(
    "--data-dir", type=SafePath(file_okay=False, path_type=Path), default=DEFAULT_DATA_DIR, show_default=True,
    help="The scheduler's folder: artifacts, scheduler.log and the default SQLite database.",
)


def _shown_url(url: str) -> str:
    """``url`` with any password masked, for messages and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return shorten(url, 200)


def _reason(exc: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's background link."""
    inner = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return shorten(lines[0] if lines else type(inner).__name__, 300)


def open_database(db: str | None, data_dir: Path, *, migrate: bool = True) -> Any:
    """An engine on the scheduler's database (upgraded to the newest schema when ``migrate``); a bad URL or an
    unreachable server is an :class:`InputError` (exit 2)."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from tinkergym.scheduler.db import database_url, make_engine, upgrade

    try:
        url = database_url(db, data_dir)
    except OSError as exc:
        raise InputError(f"cannot create the data folder {str(data_dir)!r}: {exc.strerror or exc}") from exc
    try:
        engine = make_engine(url)
        with engine.connect():
            pass
        if migrate:
            upgrade(engine)
    except (SQLAlchemyError, CommandError, ValueError, ImportError, OSError) as exc:
        raise InputError(
            f"cannot use the database {_shown_url(url)}: {_reason(exc)}. Check --db (or ${DB_ENVVAR}): "
            "sqlite:///path/scheduler.db, or postgresql://user@host:5432/name with the server running"
        ) from exc
    return engine


def check_tenant(tenant: str) -> str:
    from tinkergym.scheduler.auth import TENANT_PATTERN

    if not TENANT_PATTERN.match(tenant):
        raise click.BadParameter(
            f"{shorten(tenant, 80)!r} is not a tenant name: use lowercase letters, digits, '.', '_' and '-' "
            "(start with a letter or digit, at most 64)", param_hint="--tenant")
    return tenant


def when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def scheduler_logger(data_dir: Path) -> logging.Logger:
    """The scheduler's logger: one JSON line per request, to stderr and to ``<data-dir>/scheduler.log``."""
    logger = logging.getLogger("tinkergym.scheduler")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for old in list(logger.handlers):
        logger.removeHandler(old)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(data_dir / "scheduler.log", encoding="utf-8")):
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger


@click.group("scheduler")
def scheduler() -> None:
    """The job scheduler: GPU leases for jobs, API keys, tenants and quotas (needs the `scheduler` extra).

    \b
    Examples:
      tinkergym scheduler keys create --tenant acme --scopes read,write
      tinkergym scheduler serve --port 8780
      tinkergym scheduler serve --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
      tinkergym scheduler workers list
    """


@scheduler.command("serve")
@db_option
@data_dir_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on; keep the loopback default behind an SSH tunnel or a TLS proxy.")
@click.option("--port", type=click.IntRange(1, 65535), default=8780, show_default=True)
@click.option("--lease-ttl", type=FiniteFloat(min=0, min_open=True), default=30.0, show_default=True, metavar="S",
              help="A lease not renewed by its worker's heartbeat within this many seconds expires and its job is requeued.")
@click.option("--sweep-interval", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True, metavar="S",
              help="How often expired leases are swept (jobs are granted when workers ask).")
@click.option("--backfill-age", type=FiniteFloat(min=0), default=600.0, show_default=True, metavar="S",
              help="A queued job older than this stops smaller jobs from starting around it (no starvation).")
@click.option("--idle-timeout", type=FiniteFloat(min=0, min_open=True), default=900.0, show_default=True, metavar="S",
              help="A job's server stops when its client has made no call this long (its worker fails the job; --resume continues it).")
@click.option("--max-attempts", type=click.IntRange(min=1), default=3, show_default=True, help="Leases a job may lose before it fails.")
@click.option("--quarantine-after", type=click.IntRange(min=0), default=2, show_default=True, metavar="N",
              help="A worker whose leases expire N times in a row before the job's server came up gets no more leases until "
                   "`tinkergym scheduler workers release`; 0: never. Keep it below --max-attempts.")
@click.option("--quarantine-losses", type=click.IntRange(min=0), default=3, show_default=True, metavar="N",
              help="A worker that loses N leases within --quarantine-window while it keeps calling the scheduler gets no more "
                   "leases until `tinkergym scheduler workers release`, whatever it reported; 0: never.")
@click.option("--quarantine-window", type=FiniteFloat(min=0, min_open=True), default=3600.0, show_default=True, metavar="S",
              help="The window of --quarantine-losses.")
@click.option("--cancel-deadline", type=FiniteFloat(min=0, min_open=True), default=300.0, show_default=True, metavar="S",
              help="A cancelled job whose worker has not stopped it this long after the cancel loses its lease: it is "
                   "cancelled and its devices and the tenant's quota are free.")
@click.option("--max-body-kb", type=click.IntRange(min=1), default=1024, show_default=True, metavar="N", help="Larger request bodies are refused (413).")
@click.option("--max-artifact-gb", type=FiniteFloat(min=0, min_open=True), default=20.0, show_default=True, metavar="N",
              help="Larger checkpoint files uploaded by workers are refused (413).")
@click.option("--max-streams-per-key", type=click.IntRange(min=1), default=16, show_default=True, metavar="N",
              help="Event streams (jobs logs --follow) one key may hold open at once; one more is refused with 429.")
@click.option("--max-streams", type=click.IntRange(min=1), default=1000, show_default=True, metavar="N",
              help="Event streams open at once, all keys together; one more is refused with 429. Below --max-connections.")
@click.option("--gateway-max-per-tenant", type=click.IntRange(min=1), default=64, show_default=True, metavar="N",
              help="Requests one tenant may have in flight through the inference gateway (/v1/jobs/JOB/openai/v1/...); "
                   "one more is refused with 429.")
@click.option("--gateway-read-timeout", type=FiniteFloat(min=0, min_open=True), default=600.0, show_default=True, metavar="S",
              help="An inference job's server that sends nothing for this long ends the request forwarded by the gateway (504).")
@connection_options
@click.option("--worker-timeout", type=FiniteFloat(min=0, min_open=True), default=None, metavar="S",
              help="A worker with no call (lease poll, heartbeat) for this long is listed gone until it calls again; "
                   "at least --lease-ttl.  [default: 3 x --lease-ttl]")
@click.option("--forget-workers-after", type=FiniteFloat(min=0), default=86400.0, show_default=True, metavar="S",
              help="A worker gone this long that holds nothing is deleted (it registers again if it comes back); 0: never.")
@click.option("--checkpoint-keep", type=FiniteFloat(min=0), default=3600.0, show_default=True, metavar="S",
              help="This long after a job ended, its checkpoints but the newest are deleted (the newest is what "
                   "`tinkergym train --resume` continues from); 0: keep them all.")
@click.option("--artifact-retention", type=FiniteFloat(min=0), default=30 * 86400.0, show_default=True, metavar="S",
              help="This long after a job ended (2592000 = 30 days), all its artifacts are deleted and an event on the job "
                   "says so; never while a queued or running job continues it; 0: keep forever.")
@click.option("--retention-interval", type=FiniteFloat(min=0, min_open=True), default=60.0, show_default=True, metavar="S",
              help="How often ended jobs' artifacts are checked against --checkpoint-keep and --artifact-retention, "
                   "and ended jobs and idempotency records against --job-retention and --idempotency-ttl.")
@click.option("--job-retention", type=FiniteFloat(min=0), default=90 * 86400.0, show_default=True, metavar="S",
              help="This long after a job ended (7776000 = 90 days), it is deleted with its events, checkpoints and artifacts; "
                   "never while a queued or running job continues it; 0: no age limit (each tenant still keeps only its "
                   "newest ended jobs: tenants set --keep-ended-jobs).")
@click.option("--idempotency-ttl", type=FiniteFloat(min=0), default=86400.0, show_default=True, metavar="S",
              help="Idempotency-Key records older than this are deleted (a retry after that runs as a new request); 0: keep them.")
@click.option("--refuse-unplaceable", is_flag=True,
              help="Refuse (400) a job whose model no registered worker (alive or gone) offers, or that asks for more devices "
                   "than any worker offering its model has; by default such a job waits, its reason shown, for such a worker.")
def serve(
    db: str | None, data_dir: Path, host: str, port: int, lease_ttl: float, sweep_interval: float, backfill_age: float,
    idle_timeout: float, max_attempts: int, quarantine_after: int, quarantine_losses: int, quarantine_window: float, cancel_deadline: float, max_body_kb: int, max_artifact_gb: float, worker_timeout: float | None,
    max_streams_per_key: int, max_streams: int, header_timeout: float, body_timeout: float, max_connections: int,
    forget_workers_after: float, checkpoint_keep: float, artifact_retention: float, retention_interval: float,
    job_retention: float, idempotency_ttl: float, refuse_unplaceable: bool, gateway_max_per_tenant: int, gateway_read_timeout: float,
) -> None:
    """Serve the scheduler's HTTP API (upgrading its database first).

    \b
    Example:
      tinkergym scheduler keys create --tenant acme --scopes read,write
      tinkergym scheduler serve --data-dir scheduler-data --port 8780
      curl -H "Authorization: Bearer tgk_..." http://127.0.0.1:8780/v1/jobs
    """
    if worker_timeout is not None and worker_timeout < lease_ttl:
        raise click.BadParameter(
            f"{worker_timeout:g} s is shorter than --lease-ttl ({lease_ttl:g} s): a worker heartbeating its leases would be listed gone",
            param_hint="--worker-timeout")
    if max_streams >= max_connections:
        raise click.BadParameter(f"give fewer than --max-connections ({max_connections}): each stream holds a connection, and "
                                 "other requests need some", param_hint="--max-streams")
    if forget_workers_after and forget_workers_after < (worker_timeout or 3 * lease_ttl):
        raise click.BadParameter("a worker is forgotten only after it is gone: give at least --worker-timeout, or 0 (never)",
                                 param_hint="--forget-workers-after")
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the data folder {str(data_dir)!r}: {exc.strerror or exc}") from exc
    keep_private(data_dir)  # a data folder an older version left readable (0644 files) is the owner's alone again
    open_database(db, data_dir).dispose()  # a bad URL or an unreachable server is exit 2, before anything listens
    if not is_loopback(host):
        click.echo(f"warning: listening on {host}: API keys and data travel unencrypted unless a TLS proxy is in front.", err=True)

    import uvicorn

    from tinkergym.serve.slow_clients import server_config
    from tinkergym.scheduler.app import SchedulerSettings, create_app
    from tinkergym.scheduler.db import database_url

    url = database_url(db, data_dir)
    settings = SchedulerSettings(
        db_url=url, data_dir=data_dir, lease_ttl_s=lease_ttl, sweep_interval_s=sweep_interval, backfill_age_s=backfill_age,
        idle_timeout_s=idle_timeout, max_attempts=max_attempts, quarantine_after=quarantine_after, max_body_bytes=max_body_kb * 1024,
        cancel_deadline_s=cancel_deadline, quarantine_losses=quarantine_losses, quarantine_window_s=quarantine_window,
        max_streams_per_key=max_streams_per_key, max_streams=max_streams,
        max_artifact_bytes=int(max_artifact_gb * 1024**3), worker_timeout_s=worker_timeout, worker_forget_s=forget_workers_after,
        checkpoint_keep_s=checkpoint_keep, artifact_retention_s=artifact_retention, retention_interval_s=retention_interval,
        job_retention_s=job_retention, idempotency_ttl_s=idempotency_ttl, refuse_unplaceable=refuse_unplaceable,
        gateway_max_per_tenant=gateway_max_per_tenant, gateway_read_timeout_s=gateway_read_timeout,
    )
    app = create_app(settings, logger=scheduler_logger(data_dir.resolve()))
    click.echo(f"tinkergym scheduler on http://{host}:{port} (database {_shown_url(url)}, data {data_dir})", err=True)
    # Event streams stay open: on Ctrl-C, do not wait for them.
    config = server_config(app, connection_limits(header_timeout, body_timeout, max_connections), host=host, port=port,
                           access_log=False, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=75)
    uvicorn.Server(config).run()


@scheduler.group("keys")
def keys() -> None:
    """Make, list and revoke API keys (the only way to get one: there is no registration).

    \b
    Examples:
      tinkergym scheduler keys create --tenant acme --scopes read,write --name laptop
      tinkergym scheduler keys list --tenant acme
      tinkergym scheduler keys revoke 0123456789ab
    """


@keys.command("create")
@click.option("--tenant", required=True, help="The key's owner; created with default quotas if new.")
@click.option("--scopes", required=True, help="Comma-separated: read, write, metrics (GET /metrics, for a Prometheus scraper), admin "
              "(admin implies those), operator (reads every tenant's jobs and GET /v1/cluster: the operator's dashboard; give it "
              "with read, e.g. read,operator; admin does not imply it). Workers get a worker credential instead: "
              "tinkergym scheduler workers create.")
@click.option("--name", default="", help="A label for `keys list` (who or what holds the key).")
@db_option
@data_dir_option
def keys_create(tenant: str, scopes: str, name: str, db: str | None, data_dir: Path) -> None:
    """Make a key and print it once; only its SHA-256 digest is stored.

    The key alone goes to stdout (so it can be redirected to a file); its id and the notice go to stderr.

    \b
    Example:
      tinkergym scheduler keys create --tenant acme --scopes read,write --name laptop > key.txt && chmod 600 key.txt
    """
    from tinkergym.scheduler.auth import TENANT_SCOPES, create_key, parse_scopes

    check_tenant(tenant)
    try:
        scope_list = parse_scopes(scopes)
    except ValueError as exc:
        given = {s.strip() for s in scopes.split(",") if s.strip()}
        if "worker" in given:
            raise click.BadParameter(str(exc), param_hint="--scopes") from exc
        unknown = sorted(given - set(TENANT_SCOPES))
        what = f"unknown scope {', '.join(repr(shorten(s, 40)) for s in unknown[:5])}" if unknown else "no scope given"
        raise click.BadParameter(f"{what}: give a comma-separated list of {', '.join(TENANT_SCOPES)}", param_hint="--scopes") from exc
    if len(name) > 200:
        raise click.BadParameter("at most 200 characters", param_hint="--name")
    engine = open_database(db, data_dir)
    try:
        key_id, key = create_key(engine, tenant, scope_list, name=name)
    finally:
        engine.dispose()
    click.echo(f"created key {key_id} for tenant {tenant} (scopes {','.join(scope_list)})", err=True)
    click.echo(key)
    click.echo("this key is shown once and never again (the scheduler keeps only its digest): store it now.", err=True)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@db_option
@data_dir_option
def keys_list(tenant: str | None, db: str | None, data_dir: Path) -> None:
    """List keys: id, tenant, scopes, name, created, revoked (never the key nor its digest).

    \b
    Example:
      tinkergym scheduler keys list --tenant acme
    """
    from tinkergym.scheduler.auth import list_keys

    if tenant is not None:
        check_tenant(tenant)
    engine = open_database(db, data_dir)
    try:
        found = list_keys(engine, tenant)
    finally:
        engine.dispose()
    if not found:
        click.echo("no keys" + (f" for tenant {tenant}" if tenant else "") + "; make one with: tinkergym scheduler keys create", err=True)
        return
    rows = [(k["id"], k["tenant_id"], k["scopes"], k["name"] or "-", when(k["created_at"]), when(k["revoked_at"])) for k in found]
    click.echo(table(("ID", "TENANT", "SCOPES", "NAME", "CREATED", "REVOKED"), rows))


@keys.command("revoke")
@click.argument("key_id", metavar="ID")
@db_option
@data_dir_option
def keys_revoke(key_id: str, db: str | None, data_dir: Path) -> None:
    """Revoke a key by its id: its next request is refused (401), on a running scheduler too.

    \b
    Example:
      tinkergym scheduler keys revoke 0123456789ab
    """
    from tinkergym.scheduler.auth import list_keys, revoke_key

    engine = open_database(db, data_dir)
    try:
        if revoke_key(engine, key_id):
            click.echo(f"revoked key {key_id}")
            return
        known = {k["id"]: k for k in list_keys(engine)}
    finally:
        engine.dispose()
    if key_id in known:
        click.echo(f"key {key_id} was already revoked ({when(known[key_id]['revoked_at'])})")
        return
    raise InputError(f"no key with id {shorten(key_id, 80)!r}; see the ids with: tinkergym scheduler keys list")


@scheduler.group("tenants")
def tenants() -> None:
    """Tenants and their quotas (GPUs held at once, jobs queued at once, stored artifacts, events, ended jobs kept).

    \b
    Examples:
      tinkergym scheduler tenants set acme --max-gpus 4 --max-queued 50
      tinkergym scheduler tenants set acme --max-artifact-gb 500 --max-events-per-job 200000 --keep-ended-jobs 5000
      tinkergym scheduler tenants list
    """


@tenants.command("set")
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
@db_option
@data_dir_option
def tenants_set(
    tenant: str, max_gpus: int | None, max_queued: int | None, max_artifact_gb: float | None, max_events_per_job: int | None,
    max_event_kb: int | None, keep_ended_jobs: int | None, max_idempotency_records: int | None, max_idempotency_mb: int | None,
    db: str | None, data_dir: Path,
) -> None:
    """Create a tenant or change its quotas (the options not given keep their values).

    \b
    Example:
      tinkergym scheduler tenants set acme --max-gpus 4 --max-queued 50
      tinkergym scheduler tenants set acme --max-artifact-gb 0.5 --max-event-kb 128
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
                          max_idempotency_bytes=None if max_idempotency_mb is None else max_idempotency_mb << 20)
            row = conn.execute(select(tenants_table).where(tenants_table.c.id == tenant)).mappings().one()
    finally:
        engine.dispose()
    click.echo(f"tenant {row['id']}: max_gpus={row['max_gpus']} max_queued={row['max_queued']} "
               f"max_artifact_gb={_gib(row['max_artifact_bytes'])} max_events_per_job={row['max_events_per_job']} "
               f"max_event_kb={_kib(row['max_event_bytes'])} keep_ended_jobs={row['keep_ended_jobs']} "
               f"max_idempotency_records={row['max_idempotency_records']} max_idempotency_mb={row['max_idempotency_bytes'] >> 20}")


def _gib(n: int) -> str:
    """Bytes as GiB, as ``--max-artifact-gb`` takes them (3 decimals, or 3 significant digits below 0.001)."""
    text = f"{n / GIB:.3f}".rstrip("0").rstrip(".")
    return f"{n / GIB:.3g}" if text == "0" and n else text


def _kib(n: int) -> str:
    return f"{n / 1024:.3f}".rstrip("0").rstrip(".")


@tenants.command("list")
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
             str(t["max_events_per_job"]), _kib(t["max_event_bytes"]), str(t["keep_ended_jobs"]), when(t["created_at"])) for t in found]
    header = ("TENANT", "MAX_GPUS", "MAX_QUEUED", "MAX_ARTIFACT_GB", "STORED_GB", "MAX_EVENTS_PER_JOB", "MAX_EVENT_KB", "KEEP_ENDED_JOBS", "CREATED")
    click.echo(table(header, rows) if rows else "no tenants")


@scheduler.group("db")
def db_group() -> None:
    """The scheduler's database schema (Alembic migrations shipped in the package).

    \b
    Examples:
      tinkergym scheduler db current
      tinkergym scheduler db upgrade --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
    """


@db_group.command("upgrade")
@db_option
@data_dir_option
def db_upgrade(db: str | None, data_dir: Path) -> None:
    """Create the schema, or upgrade it to this version's (`serve` does this too at start).

    \b
    Example:
      tinkergym scheduler db upgrade --db sqlite:///scheduler-data/scheduler.db
    """
    from tinkergym.scheduler.db import current_revision

    engine = open_database(db, data_dir, migrate=False)
    try:
        before = current_revision(engine)
        engine.dispose()
        engine = open_database(db, data_dir)
        after = current_revision(engine)
    finally:
        engine.dispose()
    if before == after:
        click.echo(f"database is at revision {after} (the newest): nothing to do")
    else:
        click.echo(f"database upgraded: {before or 'empty'} -> {after}")


@db_group.command("current")
@db_option
@data_dir_option
def db_current(db: str | None, data_dir: Path) -> None:
    """Show the database's schema revision and whether it is this version's newest.

    \b
    Example:
      tinkergym scheduler db current
    """
    from alembic.script import ScriptDirectory

    from tinkergym.scheduler.db import alembic_config, current_revision

    engine = open_database(db, data_dir, migrate=False)
    try:
        revision = current_revision(engine)
        head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    finally:
        engine.dispose()
    if revision is None:
        click.echo(f"empty database (no schema); the newest revision is {head}: run tinkergym scheduler db upgrade")
    elif revision == head:
        click.echo(f"{revision} (newest)")
    else:
        click.echo(f"{revision}; the newest is {head}: run tinkergym scheduler db upgrade")
