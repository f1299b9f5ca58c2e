"""The worker's loop (:class:`Worker`): registers its devices and seats, asks for leases while some are free, and runs
a :class:`~tinkergym.scheduler.worker.agent.JobRunner` per lease (see that module for what one lease does), its server
started by the worker's launcher (:mod:`~tinkergym.scheduler.worker.launchers`: processes of this machine, or Ray actors
with ``--ray``). Standard library and :mod:`tinkergym.client` only (``prometheus_client`` with ``--metrics-port``,
``ray`` with ``--ray``)."""

from __future__ import annotations

import logging
import random
import re
import secrets
import signal
import socket
import threading
from typing import Any

from tinkergym.client import SchedulerError
from tinkergym.scheduler.worker.agent import STOP_GRACE_S, JobRunner
from tinkergym.scheduler.worker.beats import Heartbeats
from tinkergym.scheduler.worker.client import WorkerClient
from tinkergym.scheduler.worker.job_servers import WorkerOptions
from tinkergym.scheduler.worker.launchers import Launcher, ProcessLauncher
from tinkergym.scheduler.worker.seats import SharedServers

log = logging.getLogger("tinkergym.worker")
#: An idle worker (its lease requests answered with nothing) asks at most this many poll intervals apart: a cluster of a
#: thousand idle workers asks a few hundred times a second, not a thousand; a job's end here asks at once all the same.
IDLE_BACKOFF = 8


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class Worker:
    """Registers the devices, asks for leases while some are free, runs a :class:`JobRunner` per lease."""

    def __init__(self, client: WorkerClient, options: WorkerOptions, launcher: Launcher | None = None) -> None:
        self.client, self.options = client, options
        self.launcher: Launcher = launcher if launcher is not None else ProcessLauncher()
        self.runners: list[JobRunner] = []
        self.stopping = threading.Event()
        self.freed = threading.Event()  # a place came free (a job ended): ask for a lease at once, not at the next poll
        self._lock = threading.Lock()
        self._ports: set[int] = set()
        self.shared = SharedServers(options, self.take_port, self.release_port, self.launcher)
        self.metrics: Any = None  # a WorkerMetrics once count_metrics() ran (--metrics-port)
        self.heartbeats = Heartbeats()  # its leases' heartbeats, sent together

    def count_metrics(self) -> Any:
        """Start counting the worker's Prometheus metrics (see :mod:`tinkergym.scheduler.worker.metrics`); their registry."""
        from tinkergym.scheduler.worker.metrics import WorkerMetrics

        seats = sum(int(d["shared"]["seats"]) for d in self.options.devices if d.get("shared"))
        whole = sum(1 for d in self.options.devices if not d.get("shared"))
        self.metrics = WorkerMetrics(lambda: (whole, seats, self.busy()))
        return self.metrics

    def busy(self) -> set[tuple[str, Any]]:
        """The places its jobs hold: whole devices and seats."""
        with self._lock:
            return {place for runner in self.runners for place in runner.places}

    def finished(self, runner: JobRunner) -> None:
        with self._lock:
            if runner in self.runners:
                self.runners.remove(runner)
        self.freed.set()
        log.info("job %s epoch %s: %s; its devices %s are free", runner.job_id, runner.epoch, runner.outcome, runner.devices)
        if self.metrics is not None:
            self.metrics.job_ended(runner.outcome)

    def take_port(self) -> int:
        low, high = self.options.ports
        candidates = list(range(low, high + 1))
        random.shuffle(candidates)
        with self._lock:
            for port in candidates:
                if port not in self._ports and _port_free(self.options.host, port):
                    self._ports.add(port)
                    return port
        raise RuntimeError(f"no free port in {low}-{high} on {self.options.host}")

    def release_port(self, port: int) -> None:
        with self._lock:
            self._ports.discard(port)

    def register(self) -> None:
        self.client.register(self.options.name, self.options.host, self.options.devices, self.options.models, self.options.model_shapes)
        log.info("registered as %s (%s): devices %s, models %s", self.options.name, self.client.worker_id,
                 [d["index"] for d in self.options.devices], self.options.models)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or :meth:`stop`); the exit code."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        self.register()
        try:  # what an earlier process of this worker left running is stopped before any new lease
            self.launcher.reconcile(self)
        except Exception:  # noqa: BLE001 - what is left is fenced by its lease (and stops itself past it): the worker serves on
            log.exception("could not stop what an earlier process of this worker left running")
        delay = self.options.poll
        while not self.stopping.is_set():
            self.freed.clear()
            self.shared.keepalive()
            granted: list[dict[str, Any]] = []
            free = self.options.places() - len(self.busy())
            if free > 0:
                try:
                    granted = self.client.leases(free)  # every free place filled in one grant, as far as jobs fit them
                    # nothing for it: ask less often, up to IDLE_BACKOFF polls apart (a job's end here asks at once)
                    delay = self.options.poll if granted else min(delay * 2, self.options.poll * IDLE_BACKOFF)
                    if self.metrics is not None:
                        self.metrics.polls.labels("granted" if granted else "empty").inc()
                except SchedulerError as exc:
                    if self.metrics is not None:
                        self.metrics.polls.labels("error").inc()
                    if exc.status == 404:  # the scheduler does not know this worker (a new database): register again
                        self._try(self.register)
                    elif exc.status in (401, 403):  # the key: nothing this worker can do but stop
                        log.error("the scheduler refused this worker: %s", exc)
                        return 2
                    else:  # one lease's answer (a 4xx of a job, the scheduler away) never ends the worker
                        log.warning("no lease: %s", exc)
                    delay = min(delay * 2, 30.0)
            for lease in granted:
                runner = JobRunner(self, lease)
                with self._lock:
                    self.runners.append(runner)
                log.info("lease: job %s epoch %s on devices %s", runner.job_id, runner.epoch, runner.devices)
                runner.start()
            if granted:
                continue  # more places may be free: ask again at once
            if self.freed.wait(delay):  # the poll interval, or less: a job ending (or stop()) wakes it
                delay = self.options.poll
        self._stop_all()
        return 0

    def stop(self) -> None:
        self.stopping.set()
        self.freed.set()

    def _stop_all(self) -> None:
        with self._lock:
            runners = list(self.runners)
        for runner in runners:
            runner.shutdown.set()
        for runner in runners:
            runner.join(timeout=STOP_GRACE_S * 2 + 5)
        self.shared.stop()
        self.launcher.close()
        self._try(self.client.copy(retries=0, timeout=5.0).leave)  # listed gone at once, not after the worker timeout
        log.info("stopped")

    @staticmethod
    def _try(action: Any) -> None:
        try:
            action()
        except SchedulerError as exc:
            log.warning("%s", exc)


def default_name() -> str:
    """This machine's host name as a worker name (letters, digits, '.', '_' and '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:200].lstrip("._-")
    return name or f"worker-{secrets.token_hex(3)}"
