"""The options every HTTP server command shares to bound slow and surplus clients (``--header-timeout``,
``--body-timeout``, ``--max-connections``), and the :class:`~tinkergym.serve.slow_clients.ConnectionLimits` they make;
whether the interface a server listens on is loopback (else it warns that its traffic is unencrypted)."""

from __future__ import annotations

import ipaddress
from typing import Any
from collections.abc import Callable

import click

from tinkergym.serve.slow_clients import ConnectionLimits
from tinkergym.cli.common import FiniteFloat

_DEFAULTS = ConnectionLimits()


def connection_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--header-timeout``, ``--body-timeout`` and ``--max-connections`` (parameters ``header_timeout``,
    ``body_timeout``, ``max_connections``) to a server command."""
    options = [
        click.option("--header-timeout", type=FiniteFloat(min=0, min_open=True), default=_DEFAULTS.header_timeout_s, show_default=True,
                     metavar="S", help="A request whose headers are not all in within this many seconds (of connecting, or of "
                                       "its first byte on a kept-alive connection) is answered 408 and its connection closed."),
        click.option("--body-timeout", type=FiniteFloat(min=0, min_open=True), default=_DEFAULTS.body_timeout_s, show_default=True,
                     metavar="S", help=f"A request body must arrive within this many seconds, plus 1 s per "
                                       f"{int(_DEFAULTS.body_min_rate) // 1024} KiB received; a slower one is answered 408 and closed."),
        click.option("--max-connections", type=click.IntRange(min=1), default=_DEFAULTS.max_connections, show_default=True,
                     metavar="N", help="Connections served at once (event streams and long polls count); one more is "
                                       "answered 503 at once and closed."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def connection_limits(header_timeout: float, body_timeout: float, max_connections: int) -> ConnectionLimits:
    """The limits the options give."""
    return ConnectionLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout, max_connections=max_connections)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a ``--host``) is a loopback interface, reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
