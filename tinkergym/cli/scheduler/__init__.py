"""``tinkergym scheduler``: serve the job scheduler, make and revoke its API keys, set tenant quotas, make worker
credentials and list its workers, migrate its database; each a module of this folder, run on the scheduler's machine
by its operator."""

from __future__ import annotations

import click

from tinkergym.cli.scheduler.db import db_group
from tinkergym.cli.scheduler.keys import keys_group
from tinkergym.cli.scheduler.serve import serve_scheduler
from tinkergym.cli.scheduler.tenants import tenants_group
from tinkergym.cli.scheduler.workers import workers_group


@click.group("scheduler")
def scheduler_group() -> None:
    """The job scheduler: GPU leases for jobs, API keys, tenants and quotas (needs the `scheduler` extra).

    \b
    Examples:
      tinkergym scheduler keys create --tenant acme --scopes read,write
      tinkergym scheduler serve --port 8780
      tinkergym scheduler serve --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
      tinkergym scheduler workers list
    """


for _command in (serve_scheduler, keys_group, tenants_group, workers_group, db_group):
    scheduler_group.add_command(_command)

__all__ = ["scheduler_group"]
