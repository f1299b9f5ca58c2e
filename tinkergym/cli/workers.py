"""``tinkergym workers list``: the capacity a tenant's key can use (the workers that serve its tenant), from any machine."""

from __future__ import annotations

import time

import click

from tinkergym.cli.common import table
from tinkergym.cli.jobs import age, call, connect, scheduler_options


@click.group()
def workers() -> None:
    """The scheduler's workers that serve your tenant: their models, devices and whether they are busy or gone.

    \b
    Examples:
      export TINKERGYM_SCHEDULER=http://127.0.0.1:8780 TINKERGYM_API_KEY=tgk_...
      tinkergym workers list
      tinkergym workers list --alive
    """


@workers.command("list")
@click.option("--alive", "only_alive", is_flag=True, help="Only the workers alive now.")
@scheduler_options
def workers_list(only_alive: bool, scheduler_url: str | None, api_key: str | None) -> None:
    """List the workers your jobs can run on: name, status, models, devices busy of active, last seen.

    Any key with the read scope lists them; other tenants' jobs on them are never shown.

    \b
    Example:
      tinkergym workers list --scheduler http://127.0.0.1:8780
    """
    client = connect(scheduler_url, api_key)
    try:
        found = call(lambda: client.workers("alive" if only_alive else None))
    finally:
        client.close()
    if not found:
        click.echo("no workers serve your tenant" + (" now" if only_alive else "") + "; jobs wait in the queue until one registers", err=True)
        return
    now = time.time()
    rows = []
    for w in found:
        active = [d for d in w["devices"] if d["active"]]
        kinds = sorted({d["kind"] for d in active})
        status = w["status"] + (", quarantined" if w.get("quarantined") else "")
        rows.append((w["name"], status, ",".join(w["models"]) or "-", f"{len(active)} {'/'.join(kinds)}".strip(),
                     str(sum(d["busy"] for d in active)), f"{age(w['last_seen_at'], now)} ago"))
    click.echo(table(("NAME", "STATUS", "MODELS", "DEVICES", "BUSY", "LAST SEEN"), rows))
