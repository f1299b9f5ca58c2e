"""``tinkergym scheduler serve``: the scheduler's HTTP API, on its machine."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from tinkergym.cli.common import FiniteFloat, InputError
from tinkergym.cli.connection_options import connection_limits, connection_options, is_loopback
from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database, shown_url
from tinkergym.plumbing.folders import keep_private


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


@click.command("serve")
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
def serve_scheduler(
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
    click.echo(f"tinkergym scheduler on http://{host}:{port} (database {shown_url(url)}, data {data_dir})", err=True)
    # Event streams stay open: on Ctrl-C, do not wait for them.
    config = server_config(app, connection_limits(header_timeout, body_timeout, max_connections), host=host, port=port,
                           access_log=False, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=75)
    uvicorn.Server(config).run()
