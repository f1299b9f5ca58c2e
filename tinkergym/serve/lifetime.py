"""When a server started for a job should stop on its own: its parent (the worker) died, or its client went quiet.

A worker starts each job's server as a child process. If the worker is killed (``kill -9``), nothing would
stop the server, which would keep the devices and answer with a token the scheduler has moved past. So the
server stops itself:

- the kernel sends it SIGTERM when the worker dies (``PR_SET_PDEATHSIG``, set by the worker when it starts
  the process: :func:`die_with_parent`), and as a second line :class:`Watchdog` sees that it was reparented
  (``os.getppid()`` changed) within a second;
- with an idle timeout, a server whose client has sent no call for that long stops too (the client died),
  freeing the job's devices; the exit code :data:`IDLE_EXIT_CODE` tells the worker why.

Stopping is a graceful shutdown of the server (``tinkergym serve backend`` sets uvicorn's ``should_exit``), after
which the process exits with :data:`IDLE_EXIT_CODE` or :data:`ORPHAN_EXIT_CODE`.

A server that cannot start because of the machine it runs on (a package missing, the model's files missing, a
device that is not there: :func:`environment_faults`) exits with :data:`ENVIRONMENT_EXIT_CODE` and one line, so
the worker gives the job back instead of failing it; a bad setting of the job exits 2, as any bad input does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator

from tinkergym.plumbing.install import pip_install

#: The exit code of a server that stopped because its client was idle (EX_TEMPFAIL).
IDLE_EXIT_CODE = 75
#: The exit code of a server that stopped because its parent died.
ORPHAN_EXIT_CODE = 76
#: The exit code of a server that cannot run on this machine (EX_UNAVAILABLE): the machine's fault, not the job's.
ENVIRONMENT_EXIT_CODE = 69
_PR_SET_PDEATHSIG = 1


class EnvironmentFault(Exception):
    """This machine cannot run the server: a package, the model's files or a device it needs is missing."""


@contextmanager
def environment_faults() -> Iterator[None]:
    """Around a server's imports and model loading: a missing module, an :class:`EnvironmentFault` or a device error
    (a CUDA runtime error) prints one line and exits with :data:`ENVIRONMENT_EXIT_CODE`; other errors pass through."""
    try:
        yield
    except ImportError as exc:
        _environment_exit(f"a package the server needs does not import here: {type(exc).__name__}: {exc}; "
                          f"install it with: {pip_install('train,serve')}")
    except EnvironmentFault as exc:
        _environment_exit(str(exc))
    except RuntimeError as exc:
        text = str(exc)
        if not any(word in text.lower() for word in ("cuda", "nvidia", "no gpu")):
            raise
        _environment_exit(f"the server's device is not usable here: {text.splitlines()[0] if text else type(exc).__name__}")


def _environment_exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(ENVIRONMENT_EXIT_CODE)


def die_with_parent() -> None:
    """In a child process (``Popen(preexec_fn=die_with_parent)``): get SIGTERM when the parent dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:  # not Linux: the Watchdog's reparenting check still stops the server
        pass


class Watchdog:
    """A daemon thread that stops this process when its parent dies or ``last_activity`` is older than ``idle_timeout``.

    Args:
        parent_pid: The parent to outlive never (None: do not watch; the default is the current parent).
        idle_timeout: Seconds without activity before stopping (None: never).
        last_activity: Returns the monotonic time of the last client call.
        interval: Seconds between checks.
        stop: What stopping does (default: SIGTERM to this process); tests pass their own.
    """

    def __init__(
        self, *, parent_pid: int | None = None, idle_timeout: float | None = None, last_activity: Callable[[], float] | None = None,
        interval: float = 0.5, stop: Callable[[int], None] | None = None, logger: logging.Logger | None = None,
    ) -> None:
        if idle_timeout is not None and last_activity is None:
            raise ValueError("an idle timeout needs last_activity")
        self.parent_pid = parent_pid
        self.idle_timeout = idle_timeout
        self.last_activity = last_activity
        self.interval = interval
        self.exit_code: int | None = None
        self._stop = stop or (lambda _code: os.kill(os.getpid(), signal.SIGTERM))
        self._logger = logger or logging.getLogger("tinkergym.serve.lifetime")
        self._thread = threading.Thread(target=self._run, name="tinkergym-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def reason(self) -> int | None:
        """:data:`ORPHAN_EXIT_CODE` or :data:`IDLE_EXIT_CODE` when the watchdog fired, else None."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            return ORPHAN_EXIT_CODE
        if self.idle_timeout is not None and time.monotonic() - self.last_activity() > self.idle_timeout:  # type: ignore[misc]
            return IDLE_EXIT_CODE
        return None

    def _run(self) -> None:
        while self.exit_code is None:
            time.sleep(self.interval)
            code = self.reason()
            if code is not None:
                self.exit_code = code
                why = "its parent process died" if code == ORPHAN_EXIT_CODE else f"no client call for {self.idle_timeout:g} s"
                self._logger.warning('{"event": "stopping", "reason": "%s"}', why)
                self._stop(code)


class Activity:
    """Pure ASGI middleware recording when clients last used the app: requests in flight count as activity now.

    Paths in ``ignore`` (``/health`` by default: a liveness probe is not a client) and requests refused for
    their key (401, 403) do not count. Pass :meth:`last_activity` to :class:`Watchdog`.
    """

    def __init__(self, app: Callable, ignore: tuple[str, ...] = ("/health",)) -> None:
        self.app, self.ignore = app, ignore
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = time.monotonic()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.ignore:
            await self.app(scope, receive, send)
            return
        status = []

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        with self._lock:
            self._in_flight += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            with self._lock:
                self._in_flight -= 1
                if not status or status[0] not in (401, 403):
                    self._last = time.monotonic()

    def last_activity(self) -> float:
        """The monotonic time of the last request's end, or now while one runs."""
        with self._lock:
            return time.monotonic() if self._in_flight else self._last
