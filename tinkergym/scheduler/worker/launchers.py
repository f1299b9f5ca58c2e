"""Where a lease's server runs: the seam between a :class:`~tinkergym.scheduler.worker.agent.JobRunner` and the
processes it starts. Standard library only.

A launcher starts the job's server for a runner and returns a :class:`JobServer` handle, which the runner polls, renews
and stops; the runner keeps everything else (the health wait, heartbeats, checkpoints, reports). Two launchers:

- :class:`ProcessLauncher` (the default): the server is a process group of this machine, started with ``PR_SET_PDEATHSIG``
  (it dies with the worker) and ``CUDA_VISIBLE_DEVICES`` set to the leased devices (empty for CPU slots); a job on
  several devices runs its ranks under torchrun, meeting on 127.0.0.1;
- :class:`~tinkergym.scheduler.worker.ray_pool.RayLauncher` (``tinkergym worker --ray``): one Ray actor per rank in a
  placement group, on whichever nodes of the cluster hold the job's devices.

A launcher starts the worker's shared training servers too (:meth:`Launcher.start_shared`, for
:mod:`~tinkergym.scheduler.worker.seats`), with the same handle.

A server that is gone without an exit code of its own (its Ray actor or node died) raises :class:`ServerLost` from
:meth:`JobServer.exit_code`: the runner stops what is left of it and lets the lease expire, so the job is queued again
and resumes from its last checkpoint, as when a whole worker dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any, Protocol

from tinkergym.scheduler.worker.job_servers import die_with_parent, server_command

log = logging.getLogger("tinkergym.worker")

#: Seconds a stopping server gets between SIGTERM and SIGKILL, and between SIGKILL and giving up on it.
STOP_GRACE_S = 10.0
#: A shared server's own lease, renewed by its worker every :data:`SHARED_RENEW_S` while it runs: one that cannot read its
#: worker's life (a Ray actor's) stops when it ends (a grace later), should the worker die and not start again.
SHARED_LEASE_S = 60.0
SHARED_RENEW_S = 10.0


class ServerLost(Exception):
    """The job's server is gone without an exit code of its own (its Ray actor or node died): the lease ends as a lost one."""


class JobServer(Protocol):
    """A started job server, as its runner sees it."""

    host: str
    port: int

    def exit_code(self) -> int | None:
        """The server's exit code once it exited, None while it runs; :class:`ServerLost` when it is gone without one."""

    def kill(self) -> None:
        """Stop it at once (SIGKILL), from any thread; :meth:`stop` still follows."""

    def stop(self, graceful: bool) -> None:
        """Stop it (SIGTERM and :data:`STOP_GRACE_S` first when ``graceful``), wait for it, and free what it held."""

    def renew(self, seconds: float) -> None:
        """The lease holds ``seconds`` more from now (where the server cannot read the runner's own lease file)."""

    def started(self) -> None:
        """The server answered, or exited, while starting: ports held for it can go back to the pool."""


class Launcher(Protocol):
    """Starts a lease's server for a runner (see the module's notes)."""

    def launch(self, runner: Any) -> JobServer:
        """Start the server of ``runner``'s lease (not waiting for it to answer); a :class:`ValueError` for a config it cannot start."""

    def start_shared(self, server: Any, check: Callable[[], None]) -> JobServer:
        """Start a shared training server (a :class:`~tinkergym.scheduler.worker.seats.SharedServer`: its ``command(host, port)``);
        ``check`` is called while waiting (it raises to give up)."""

    def reconcile(self, worker: Any) -> None:
        """At the worker's start: stop what an earlier process of this worker left running."""

    def close(self) -> None:
        """The worker stopped."""


def spawn_lasting(command: list[str], env: dict[str, str], cwd: str | os.PathLike[str], log_file: str | os.PathLike[str]) -> subprocess.Popen:
    """Start ``command`` in a new session, its output appended to ``log_file``, with ``PR_SET_PDEATHSIG``, from a thread of
    its own that lives as long as the process: the signal fires when the *thread* that started the process ends (a job's
    thread ends with its job; a shared server outlives it)."""
    found: dict[str, Any] = {}
    started = threading.Event()

    def spawn() -> None:
        try:
            with open(log_file, "ab") as out:
                found["process"] = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                    cwd=cwd, start_new_session=True, preexec_fn=die_with_parent)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            found["error"] = exc
        finally:
            started.set()
        if "process" in found:
            found["process"].wait()

    threading.Thread(target=spawn, name=f"server-{os.path.basename(str(cwd))}", daemon=True).start()
    started.wait()
    if "error" in found:
        raise found["error"]
    return found["process"]


class ProcessServer:
    """A job's server as a process group of this machine (the default launcher's handle)."""

    def __init__(self, process: subprocess.Popen, host: str, port: int, ports: list[int], release_port: Callable[[int], None]) -> None:
        self.process, self.host, self.port = process, host, port
        self._ports, self._release_port = ports, release_port

    def exit_code(self) -> int | None:
        return self.process.poll()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        if self.process.poll() is None:
            self._signal(signal.SIGKILL)

    def stop(self, graceful: bool) -> None:
        if graceful and self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("the server (pid %s) did not stop", self.process.pid)
        self._signal(signal.SIGKILL)  # anything the server started in its group
        self.started()

    def renew(self, seconds: float) -> None:
        """Nothing: the server reads the lease file its runner writes, on this machine's clock."""

    def started(self) -> None:
        ports, self._ports = self._ports, []
        for port in ports:
            self._release_port(port)


class ProcessLauncher:
    """Runs each lease's server as a process group of this machine (see the module's notes)."""

    def launch(self, runner: Any) -> ProcessServer:
        options, devices, worker = runner.options, runner.devices, runner.worker
        gpu = any(d["kind"] == "gpu" for d in options.devices if d["index"] in devices)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in devices) if gpu else "", PYTHONUNBUFFERED="1")
        env.pop("TINKERGYM_API_KEY", None)  # the worker's key stays with the worker: the job's server has its lease token only
        port = worker.take_port()
        ports = [port]
        try:
            master = worker.take_port() if len(devices) > 1 else None  # where a sharded server's ranks meet
            if master is not None:
                ports.append(master)
            command = server_command(options, runner.lease, port, runner.folder, gpu, runner.served, master_port=master)
            with open(runner.folder / "server.out", "ab") as out:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                           cwd=runner.folder, start_new_session=True, preexec_fn=die_with_parent)
        except BaseException:
            for taken in ports:
                worker.release_port(taken)
            raise
        return ProcessServer(process, options.host, port, ports, worker.release_port)

    def start_shared(self, server: Any, check: Callable[[], None]) -> ProcessServer:
        device = server.device
        gpu = device["kind"] == "gpu"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device["index"]) if gpu else "", PYTHONUNBUFFERED="1")
        env.pop("TINKERGYM_API_KEY", None)  # the worker's key stays with the worker
        host = server.options.host
        port = server.take_port()
        try:
            process = spawn_lasting(server.command(host, port), env, server.folder, server.folder / "server.out")
        except BaseException:
            server.release_port(port)
            raise
        return ProcessServer(process, host, port, [port], server.release_port)

    def reconcile(self, worker: Any) -> None:
        """Nothing: this worker's servers died with the process that started them (``PR_SET_PDEATHSIG``)."""

    def close(self) -> None:
        pass
