"""Ctrl-C in commands that hold a scheduler job: the first stops the work and ends (or leaves) the job, a second exits at once."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, NoReturn
from collections.abc import Callable, Iterator

import click

#: The exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: The signals that stop such a command as Ctrl-C does: SIGTERM too (``kill``, ``timeout``, a batch system's
#: notice before it kills), so a job is never left queued or running by a client that was told to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def second_interrupt_exits(note: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Within: the first Ctrl-C (or SIGTERM) raises :class:`KeyboardInterrupt`; a further one exits at once with code 130.

    The first one's handling (ending a job over the network) may wait on a server that does not answer; the
    second one never waits: it writes ``note()`` (what is left behind) to stderr and ends the process.
    """
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def second(signum: int, frame: Any) -> None:
        os.write(2, f"\nCtrl-C again: exiting at once{note()}\n".encode("utf-8", "replace"))
        os._exit(EXIT_INTERRUPTED)

    def first(signum: int, frame: Any) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, second)
        raise KeyboardInterrupt

    previous = {each: signal.signal(each, first) for each in STOP_SIGNALS}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def stop_job(client: Any, job_id: str, keep: bool) -> str:
    """After Ctrl-C: cancel job ``job_id`` (its devices are freed), or leave it (``keep``); the job's state, or ``unknown``."""
    from tinkergym.client import TERMINAL_STATES, SchedulerError

    client.close()  # the interrupted request may have left the connection mid-answer
    try:
        if keep:
            return client.show(job_id)["state"]
        job = client.show(job_id)
        if job["state"] in TERMINAL_STATES:
            return job["state"]
        click.echo(f"job {job_id}: cancelling it (Ctrl-C again to exit at once)", err=True)
        return client.cancel(job_id)["state"]
    except (SchedulerError, OSError) as exc:
        click.echo(f"job {job_id}: could not reach the scheduler ({exc}); end it with: tinkergym jobs cancel {job_id}", err=True)
        return "unknown"


def job_outcome(job_id: str, state: str) -> str:
    """How a job stands after :func:`stop_job` cancelled it, for the message of an interrupted command."""
    if state in ("cancelled", "cancelling"):
        return f"job {job_id} is cancelled and its devices are freed"
    if state == "unknown":
        return f"job {job_id} may still hold its devices (end it with: tinkergym jobs cancel {job_id})"
    return f"job {job_id} had already ended ({state})"


def interrupted(message: str) -> NoReturn:
    """Say ``message`` on stderr and exit with code 130."""
    click.echo(message, err=True)
    raise click.exceptions.Exit(EXIT_INTERRUPTED)
