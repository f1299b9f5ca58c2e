"""What the server commands share: their options (where they listen, body size, lease file, metrics port, per-call
limits), their request log, and the uvicorn run with the watchdog that stops an idle or orphaned server."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from tinkergym.config import DEFAULT_DTYPE, DTYPES
from tinkergym.serve.training.calls import CallLimits
from tinkergym.cli.common import InputError, SafePath

TOKEN_HINT = (
    'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))" > token.txt && chmod 600 token.txt'
)


def request_logger(run_dir: Path) -> logging.Logger:
    """The server's logger: one JSON line per request and call, to stderr and to ``<run-dir>/server.log``."""
    logger = logging.getLogger("tinkergym.serve.training.app")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(run_dir / "server.log", encoding="utf-8")):
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger


# Options of every server command (serve backend, shared, model, tinker) that takes them, alike in each.
HOST_OPTION = click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on; keep the loopback default behind an SSH tunnel or a TLS proxy.")
MAX_BODY_OPTION = click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True, help="Larger request bodies are refused (413).")
EXIT_WITH_PARENT_OPTION = click.option("--exit-with-parent", is_flag=True, help="Stop (exit code 76) when the process that started this server dies (a worker).")
METRICS_PORT_OPTION = click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, show_default=True,
                                   help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics: a listener of its own, on loopback, with "
                                        "no key (counts and latencies, never ids); 0: off.")
LEASE_FILE_OPTION = click.option("--lease-file", type=SafePath(dir_okay=False, path_type=Path), default=None,
              help="A scheduler's worker renews the lease's deadline in this file; past it every call is refused (401 lease_ended).")


def device_options(command: Any) -> Any:
    """--dtype and --device of a server that loads a model (the compute dtype and where the model runs)."""
    command = click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu, cuda, cuda:1, ...")(command)
    return click.option("--dtype", type=click.Choice(DTYPES), default=DEFAULT_DTYPE, show_default=True)(command)


def call_limit_options(command: Any) -> Any:
    """The --max-* options that bound one call (see :class:`~tinkergym.serve.training.calls.CallLimits`)."""
    options = [
        click.option("--max-num-samples", type=click.IntRange(min=1), default=CallLimits.num_samples, show_default=True, help="Most completions per prompt in one sample call."),
        click.option("--max-request-new-tokens", type=click.IntRange(min=1), default=CallLimits.new_tokens, show_default=True, help="Most max_new_tokens of one sample call."),
        click.option("--max-request-sequences", type=click.IntRange(min=1), default=CallLimits.sequences, show_default=True,
                     help="Most sequences one call holds: a sample call's prompts x num_samples, a training or scoring call's rows."),
        click.option("--max-request-tokens", type=click.IntRange(min=1), default=CallLimits.tokens, show_default=True,
                     help="Most tokens one call holds: prompt plus new tokens of every sequence a sample call makes, a training call's row lengths."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def call_limits(max_num_samples: int, max_request_new_tokens: int, max_request_sequences: int, max_request_tokens: int) -> CallLimits:
    return CallLimits(num_samples=max_num_samples, new_tokens=max_request_new_tokens, sequences=max_request_sequences, tokens=max_request_tokens)


def start_metrics(metrics: Any, port: int) -> None:
    """``--metrics-port``: ``metrics`` (a :class:`~tinkergym.serve.metrics.ServerMetrics`) on 127.0.0.1:``port``, or a clear error."""
    from tinkergym.serve.metrics import serve_metrics

    try:
        serve_metrics(metrics, port)
    except OSError as exc:
        raise InputError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc}); pick a free port") from exc


def run_server(app: Any, host: str, port: int, limits: Any, idle_timeout: float | None, exit_with_parent: bool,
               last_activity: Any, logger: logging.Logger, metrics_port: int = 0) -> None:
    """Serve ``app`` under uvicorn until stopped; with ``idle_timeout`` or ``exit_with_parent``, a watchdog stops it (exit 75, 76);
    with ``metrics_port``, ``app.state.metrics`` on its own loopback listener (:func:`~tinkergym.serve.metrics.serve_metrics`)."""
    import uvicorn

    from tinkergym.serve.slow_clients import server_config

    if metrics_port:
        start_metrics(app.state.metrics, metrics_port)

    # Long polls hold requests open for up to 300 s: on Ctrl-C, do not wait for them.
    # Keep-alive well past the client's pauses between calls (rollouts, env steps), so its connection is reused.
    server = uvicorn.Server(server_config(app, limits, host=host, port=port,
                                         access_log=False, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=75))
    watchdog = None
    if idle_timeout is not None or exit_with_parent:
        from tinkergym.serve.lifetime import Watchdog

        watchdog = Watchdog(parent_pid=os.getppid() if exit_with_parent else None, idle_timeout=idle_timeout,
                            last_activity=last_activity, logger=logger,
                            stop=lambda _code: setattr(server, "should_exit", True)).start()
    server.run()
    if watchdog is not None and watchdog.exit_code is not None:
        sys.exit(watchdog.exit_code)
