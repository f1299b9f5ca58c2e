"""``tinkergym scheduler workers``: the operator's worker credentials (create, list, revoke, set bounds) and workers
(list, release from quarantine).

A worker credential is made here, on the scheduler's machine, and nowhere else: a tenant's key (``admin`` included)
never acts as a worker. Each credential names the devices it may register (count and kind), the models its workers
may offer and, optionally, the tenants they serve (:mod:`tinkergym.scheduler.credentials`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from tinkergym.cli.common import FiniteFloat, InputError, shorten, table, when
from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database
from tinkergym.cli.scheduler.tenants import check_tenant
from tinkergym.cli.jobs.workers import DeviceCount

_DEVICES = click.option("--devices", type=click.IntRange(1, 4096), required=True,
                        help="How many devices the credential may register, across all its workers.")
_KIND = click.option("--kind", type=click.Choice(["gpu", "slot"]), default=None,
                     help="The kind of device it registers (gpu, or slot for CPU slots); default either.")
_MODELS = click.option("--model", "models", multiple=True, metavar="NAME",
                       help="A model its workers may offer (repeat it); default any.")
_TENANTS = click.option("--tenant", "tenant_list", multiple=True, metavar="TENANT",
                        help="A tenant whose jobs its workers run (repeat it): the tenant's own pool; default every tenant.")


def _bound_options(command: Any) -> Any:
    """The bounds' options (devices, kind, models, tenants) and the database's, on ``command``."""
    for option in reversed((_DEVICES, _KIND, _MODELS, _TENANTS, db_option, data_dir_option)):
        command = option(command)
    return command


def _bounds(devices: int, kind: str | None, models: tuple[str, ...], tenant_list: tuple[str, ...]) -> Any:
    from tinkergym.scheduler.credentials import WorkerBounds
    from tinkergym.config import is_model_name

    bad = [m for m in models if not is_model_name(m)]
    if bad:
        raise click.BadParameter(f"not a model name: {shorten(bad[0], 100)!r}", param_hint="--model")
    for tenant in tenant_list:
        check_tenant(tenant)
    return WorkerBounds(devices, kind, tuple(sorted(set(models))) or None, tuple(sorted(set(tenant_list))) or None)


@click.group("workers")
def workers_group() -> None:
    """Worker credentials (made only here) and the workers that registered with them.

    \b
    Examples:
      tinkergym scheduler workers create gpu-host-1 --devices 4 --kind gpu --model org/model > worker-key.txt
      tinkergym scheduler workers create acme-pool --devices 8 --tenant acme
      tinkergym scheduler workers credentials
      tinkergym scheduler workers list --gone
      tinkergym scheduler workers release wkr_0123456789abcdef
    """


@workers_group.command("create")
@click.argument("name")
@_bound_options
def workers_create(name: str, devices: int, kind: str | None, models: tuple[str, ...], tenant_list: tuple[str, ...],
                   db: str | None, data_dir: Path) -> None:
    """Make a worker credential NAME and print its key once; only its SHA-256 digest is stored.

    The key alone goes to stdout (redirect it to a file); start the worker with it in TINKERGYM_API_KEY.
    A registration beyond the credential's bounds is refused (403), and its workers lease only jobs within them.

    \b
    Example:
      tinkergym scheduler workers create gpu-host-1 --devices 4 --kind gpu > worker-key.txt && chmod 600 worker-key.txt
    """
    from tinkergym.scheduler.credentials import create_worker_key

    if len(name) > 200:
        raise click.BadParameter("at most 200 characters", param_hint="NAME")
    bounds = _bounds(devices, kind, models, tenant_list)
    engine = open_database(db, data_dir)
    try:
        key_id, key = create_worker_key(engine, bounds, name=name)
    finally:
        engine.dispose()
    click.echo(f"created worker credential {key_id} ({name}): {bounds.describe()}", err=True)
    click.echo(key)
    click.echo("this key is shown once and never again (the scheduler keeps only its digest): store it now.", err=True)


@workers_group.command("set")
@click.argument("key_id", metavar="ID")
@_bound_options
def workers_set(key_id: str, devices: int, kind: str | None, models: tuple[str, ...], tenant_list: tuple[str, ...],
                db: str | None, data_dir: Path) -> None:
    """Replace the bounds of worker credential ID (models and tenants apply at its next lease, devices at its next registration).

    \b
    Example:
      tinkergym scheduler workers set 0123456789ab --devices 8 --kind gpu --tenant acme
    """
    from tinkergym.scheduler.credentials import set_worker_bounds

    bounds = _bounds(devices, kind, models, tenant_list)
    engine = open_database(db, data_dir)
    try:
        changed = set_worker_bounds(engine, key_id, bounds)
    finally:
        engine.dispose()
    if not changed:
        raise InputError(f"no worker credential with id {shorten(key_id, 80)!r}; see them with: tinkergym scheduler workers credentials")
    click.echo(f"worker credential {key_id}: {bounds.describe()}")


@workers_group.command("credentials")
@db_option
@data_dir_option
def workers_credentials(db: str | None, data_dir: Path) -> None:
    """List worker credentials: id, name, bounds, created, revoked (never the key nor its digest).

    \b
    Example:
      tinkergym scheduler workers credentials
      tinkergym scheduler keys revoke 0123456789ab   # revoke one: its workers' next calls are refused
    """
    from tinkergym.scheduler.credentials import list_worker_keys

    engine = open_database(db, data_dir)
    try:
        found = list_worker_keys(engine)
    finally:
        engine.dispose()
    if not found:
        click.echo("no worker credentials; make one with: tinkergym scheduler workers create NAME --devices N", err=True)
        return
    rows = [(k["id"], k["name"] or "-", k["bounds"].describe() if k["bounds"] else "(unreadable: revoke it)", when(k["created_at"]),
             when(k["revoked_at"])) for k in found]
    click.echo(table(("ID", "NAME", "BOUNDS", "CREATED", "REVOKED"), rows))


@workers_group.command("list")
@click.option("--worker-timeout", type=FiniteFloat(min=0, min_open=True), default=90.0, show_default=True, metavar="S",
              help="A worker not seen for this long is shown gone: give the `serve --worker-timeout` (3 x its --lease-ttl).")
@click.option("--gone", "only_gone", is_flag=True, help="Only the gone workers.")
@db_option
@data_dir_option
def workers_list(worker_timeout: float, only_gone: bool, db: str | None, data_dir: Path) -> None:
    """List workers: id, name, host, status (alive, gone; quarantined), devices busy of active (a device shared by seats counts
    once; its seats busy of all beside it), last seen, why quarantined.

    \b
    Example:
      tinkergym scheduler workers list --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
    """
    from sqlalchemy import select

    from tinkergym.scheduler.db import workers as workers_table
    from tinkergym.scheduler.leases import GONE, worker_view

    engine = open_database(db, data_dir)
    now = time.time()
    try:
        with engine.connect() as conn:
            ids = conn.execute(select(workers_table.c.id).order_by(workers_table.c.registered_at, workers_table.c.id)).scalars().all()
            found = [v for v in (worker_view(conn, i, now=now, timeout=worker_timeout) for i in ids) if v is not None]
    finally:
        engine.dispose()
    rows = []
    for w in found:
        if only_gone and w["status"] != GONE:
            continue
        count = DeviceCount.of(w["devices"])
        seen = f"{when(w['last_seen_at'])} ({_ago(now - w['last_seen_at'])} ago)"
        status = w["status"] + (", quarantined" if w["quarantined"] else "")
        busy = f"{count.busy}/{count.total}" + (f" (seats {count.busy_seats}/{count.seats})" if count.seats else "")
        rows.append((w["id"], w["name"], w["host"], status, busy, seen, quarantine_reason(w)))
    if not rows:
        click.echo("no gone workers" if only_gone and found else "no workers", err=True)
        return
    click.echo(table(("ID", "NAME", "HOST", "STATUS", "BUSY", "LAST SEEN", "QUARANTINE REASON"), rows))


@workers_group.command("release")
@click.argument("worker_id", metavar="WORKER_ID")
@db_option
@data_dir_option
def workers_release(worker_id: str, db: str | None, data_dir: Path) -> None:
    """End a worker's quarantine (its leases expired before their job's server came up, too many times in a row).

    \b
    Example:
      tinkergym scheduler workers release wkr_0123456789abcdef
    """
    from tinkergym.scheduler.leases import release_worker
    from tinkergym.scheduler.repository import JobStore

    engine = open_database(db, data_dir)
    try:
        released = release_worker(JobStore(engine), worker_id)
    finally:
        engine.dispose()
    if not released:
        raise InputError(f"no worker {shorten(worker_id, 80)!r}; see them with: tinkergym scheduler workers list")
    click.echo(f"released worker {worker_id}: it takes leases again")


def quarantine_reason(worker: dict[str, Any]) -> str:
    """Why ``worker`` is quarantined, on one line and at most 120 characters ("-" when it is not)."""
    if not worker["quarantined"]:
        return "-"
    # A worker quarantined before the reason was stored (migration 0005) was quarantined for its strikes.
    reason = worker["quarantine_reason"] or f"{worker['strikes']} of its leases in a row expired before the job's server came up"
    return shorten(" ".join(reason.split()), 120)


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
