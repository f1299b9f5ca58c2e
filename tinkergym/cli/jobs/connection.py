"""How a client command reaches the scheduler: ``--scheduler`` and ``--api-key``, the client they make, and the
scheduler's refusals as exit codes."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import click

from tinkergym.cli.common import InputError
from tinkergym.client import API_KEY_ENV, SCHEDULER_ENV


def scheduler_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--scheduler`` and ``--api-key`` (from the environment by default) on a jobs command."""
    command = click.option(
        "--api-key", envvar=API_KEY_ENV, show_envvar=True, metavar="KEY",
        help="An API key from `tinkergym scheduler keys create` (tgk_...). Prefer the environment variable: "
        "a key on the command line ends up in the shell history.",
    )(command)
    return click.option(
        "--scheduler", "scheduler_url", envvar=SCHEDULER_ENV, show_envvar=True, metavar="URL",
        help="The scheduler, e.g. http://127.0.0.1:8780.",
    )(command)


def connect(scheduler_url: str | None, api_key: str | None) -> Any:
    """A :class:`~tinkergym.client.SchedulerClient`; no URL or no key is bad input (exit 2) with a message saying how to give one."""
    from tinkergym.client import SchedulerClient
    from tinkergym.errors import ConfigError

    if not api_key or not api_key.strip():
        raise InputError(f"no API key: pass --api-key KEY or set {API_KEY_ENV} (an admin makes one with `tinkergym scheduler keys create`)")
    if not scheduler_url:
        raise InputError(f"no scheduler: pass --scheduler URL or set {SCHEDULER_ENV} (e.g. http://127.0.0.1:8780)")
    try:
        return SchedulerClient(scheduler_url, api_key)
    except ConfigError as exc:
        raise InputError(str(exc)) from exc


def call(action: Callable[[], Any]) -> Any:
    """Run a client call; the scheduler's refusals become exit 2 (bad request, key or id) or 1 (the scheduler failed)."""
    from tinkergym.client import SchedulerError

    try:
        return action()
    except SchedulerError as exc:
        if exc.input_error:
            raise InputError(str(exc)) from exc
        raise click.ClickException(str(exc)) from exc
