"""``tinkergym jobs``: the client's side of the scheduler: a tenant's jobs (list, show, cancel, logs, download) and the
workers that serve it; each a module of this folder."""

from __future__ import annotations

import click

from tinkergym.cli.jobs.download import download_command
from tinkergym.cli.jobs.queue import cancel_command, list_command, logs_command, show_command
from tinkergym.cli.jobs.workers import workers_command


@click.group("jobs")
def jobs_group() -> None:
    """Your side of the scheduler: your jobs (list, show, cancel, logs: --follow streams them as they happen; download a
    checkpoint) and the workers that serve your tenant.

    Every command needs the scheduler's URL (--scheduler or TINKERGYM_SCHEDULER) and an API key
    (--api-key or TINKERGYM_API_KEY). Exit codes: 2 for bad input (no key, a refused key, an unknown
    job id), 1 when the scheduler fails or cannot be reached, or refuses the action (cancelling an ended job).

    \b
    Examples:
      export TINKERGYM_SCHEDULER=http://127.0.0.1:8780 TINKERGYM_API_KEY=tgk_...
      tinkergym jobs list --state queued,running
      tinkergym jobs show job_0123
      tinkergym jobs logs job_0123 --follow
      tinkergym jobs cancel job_0123
      tinkergym jobs workers --alive
    """


for _command in (list_command, show_command, cancel_command, logs_command, download_command, workers_command):
    jobs_group.add_command(_command)

__all__ = ["jobs_group"]
