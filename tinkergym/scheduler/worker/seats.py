"""The worker's shared training servers and the seats its LoRA jobs take on them (:mod:`tinkergym.scheduler.seats`).

A device given with ``tinkergym worker --shared-devices`` runs one ``tinkergym serve shared`` (:class:`SharedServer`):
started at the first seat lease of that device, in ``<work-dir>/shared/<device>/`` (its own random token in the 0600
file ``token``, its run folder), by the worker's launcher (:mod:`~tinkergym.scheduler.worker.launchers`: a process with
``CUDA_VISIBLE_DEVICES`` set to the device and ``PR_SET_PDEATHSIG``, so it dies with the worker; with ``--ray``, a Ray
actor on one GPU, or CPU, of the cluster: :mod:`~tinkergym.scheduler.worker.ray_pool`) and ``--exit-with-parent``; it
holds the base model once and stays up while the worker runs.

A seat lease is a :class:`Seat`: its job's session is the adapter ``<job>.<epoch>`` of the device's server, opened with
the SHA-256 of the lease's token (the job's owner reaches it with that token, through the scheduler's connection, as
a whole server), the job's rank, alpha and seed, and bound to the lease (``PUT /v1/adapters/<id>/lease`` with the
epoch at every renewal: past the lease's end the adapter refuses every call, so a frozen worker's seat stops serving
when its lease ends, and an older epoch cannot renew it; the lease's seconds left, not a deadline, so the server may run
on another machine). Its states live in ``adapters/<id>/states/``, restored there
before the adapter opens and uploaded from there as a whole server's are. The seat ends by closing the adapter and
deleting its folder (its memory is freed; what the scheduler stored stays). A server that exits takes its seats'
jobs back to the queue as a worker fault (:class:`~tinkergym.scheduler.worker.faults.WorkerFault`); the next seat
lease starts it again. Standard library only.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import secrets
import shutil
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.client import player_token
from tinkergym.config import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK
from tinkergym.plumbing.folders import write_private_file
from tinkergym.scheduler.worker.checks import last_line, log_tail, server_fault
from tinkergym.scheduler.worker.faults import JobFault, WorkerFault
from tinkergym.scheduler.worker.launchers import SHARED_LEASE_S, SHARED_RENEW_S, JobServer, Launcher, ServerLost

log = logging.getLogger("tinkergym.worker")

START_TIMEOUT_S = 900.0
LOG_TAIL = 3000


class SharedServer:
    """One ``serve shared`` server on one device of the worker, started by the worker's launcher (see the module's notes)."""

    def __init__(self, device: dict[str, Any], options: Any, take_port: Callable[[], int], release_port: Callable[[int], None],
                 launcher: Launcher) -> None:
        self.device, self.options, self.launcher = device, options, launcher
        self.spec: dict[str, Any] = device["shared"]
        self.take_port, self.release_port = take_port, release_port
        self.folder = options.work_dir / "shared" / str(device["index"])
        self.handle: JobServer | None = None
        self.token = ""
        self._lock = threading.Lock()

    @property
    def host(self) -> str:
        handle = self.handle
        return handle.host if handle is not None else self.options.host

    @property
    def port(self) -> int | None:
        handle = self.handle
        return handle.port if handle is not None else None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited; None while it runs (or before it started); :class:`ServerLost` when it
        is gone without one (its Ray actor or node died)."""
        handle = self.handle
        return handle.exit_code() if handle is not None else None

    def running(self) -> bool:
        """Whether it was started and has not exited (nor been lost)."""
        try:
            return self.handle is not None and self.exit_code() is None
        except ServerLost:
            return False

    def ensure(self, check: Callable[[], None]) -> None:
        """Start the server unless it runs; ``check`` is called while waiting (it raises to give up)."""
        with self._lock:
            if self.running():
                return
            self._drop(graceful=False)  # one that exited or was lost: what it held goes back
            self.folder.mkdir(parents=True, exist_ok=True)
            self.token = secrets.token_urlsafe(32)
            write_private_file(self.folder / "token", self.token + "\n")
            for _attempt in range(3):
                self.handle = self.launcher.start_shared(self, check)
                try:
                    if self._wait_healthy(check):
                        log.info("shared server of device %s: %s at %s", self.device["index"], self.spec["model"], self.url)
                        return
                finally:
                    if self.handle is not None:
                        self.handle.started()
            raise WorkerFault(f"the shared server of device {self.device['index']} could not bind a port in "
                              f"{self.options.ports[0]}-{self.options.ports[1]}: {last_line(self.log_tail(), 'no log')}")

    def command(self, host: str, port: int) -> list[str]:
        """The server's command line, listening on ``host``:``port``."""
        gpu = self.device["kind"] == "gpu"
        return [self.options.python, "-m", "tinkergym", "serve", "shared", "--model", self.spec["model"], "--dtype", self.spec["dtype"],
                "--device", "auto" if gpu else "cpu", "--max-lora-rank", str(self.spec["max_lora_rank"]),
                "--max-adapters", str(self.spec["seats"]), "--host", host, "--port", str(port),
                "--token-file", str(self.folder / "token"), "--run-dir", str(self.folder / "run"), "--keep-states", "0",
                "--exit-with-parent"]

    def _wait_healthy(self, check: Callable[[], None]) -> bool:
        """Whether ``/health`` answered; False when the server exited because its port was taken."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            check()
            code = self.exit_code()
            if code is not None:
                tail = self.log_tail()
                self._drop(graceful=False)
                if "address already in use" in tail.lower() and code != 0:
                    return False
                raise WorkerFault(f"the shared server of device {self.device['index']} exited with code {code} while starting: "
                                  f"{server_fault(code, tail) or last_line(tail, 'no log')}")
            try:
                status, _ = self._http("GET", "/health", timeout=2)
                if status == 200:
                    return True
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        self.stop()
        raise WorkerFault(f"the shared server of device {self.device['index']} did not answer /health within {START_TIMEOUT_S:g}s")

    def _http(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
        port = self.port
        if port is None:
            raise ConnectionError(f"the shared server of device {self.device['index']} is not running")
        conn = http.client.HTTPConnection(self.host, port, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {self.token}"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            text = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(text) if text else None
        except ValueError:
            return response.status, None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """An admin call; its JSON answer. A 4xx is :class:`JobFault` (the job's request), no answer or a 5xx :class:`WorkerFault`."""
        try:
            status, answer = self._http(method, path, body)
        except (OSError, http.client.HTTPException) as exc:
            raise WorkerFault(f"the shared server of device {self.device['index']} did not answer: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            message = ((answer or {}).get("error") or {}).get("message") if isinstance(answer, dict) else None
            fault = JobFault if 400 <= status < 500 else WorkerFault
            raise fault(f"the shared server refused {method} {path.split('?')[0]} ({status}): {message or answer}")
        return answer

    def log_tail(self) -> str:
        return log_tail(self.folder / "server.out", LOG_TAIL)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL) and free what it held."""
        self._drop(graceful=True)

    def _drop(self, graceful: bool) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.stop(graceful)


class SharedServers:
    """The worker's shared servers, one per shared device, started on first use."""

    def __init__(self, options: Any, take_port: Callable[[], int], release_port: Callable[[int], None], launcher: Launcher) -> None:
        self.servers = {d["index"]: SharedServer(d, options, take_port, release_port, launcher) for d in options.devices if d.get("shared")}
        self._renewed_at = 0.0

    def keepalive(self) -> None:
        """Renew the running servers' own lease (:data:`SHARED_LEASE_S`), every :data:`SHARED_RENEW_S` at most (the worker's loop calls it)."""
        if not self.servers or time.monotonic() - self._renewed_at < SHARED_RENEW_S:
            return
        self._renewed_at = time.monotonic()
        for server in self.servers.values():
            handle = server.handle
            if handle is not None:
                try:
                    handle.renew(SHARED_LEASE_S)
                except Exception as exc:  # noqa: BLE001 - a server that cannot be told is seen gone at its next seat's look
                    log.warning("could not renew the shared server of device %s: %s", server.device["index"], exc)

    def __getitem__(self, device: int) -> SharedServer:
        return self.servers[device]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


class Seat:
    """One seat lease: its job's adapter on the device's shared server (see the module's notes); a league's lease (its
    seats: ``lease["seats"]``) one adapter a player, ``<job>.<epoch>`` for player 0 and ``<job>.<epoch>.p<i>`` for the
    others, each opened with the player's token (:func:`tinkergym.client.player_token`) and seed ``seed + i``."""

    def __init__(self, server: SharedServer, lease: dict[str, Any]) -> None:
        self.server, self.lease = server, lease
        self.adapter_id = f"{lease['job_id']}.{lease['epoch']}"
        players = len(lease.get("seats") or ()) or 1
        self.adapter_ids = [self.adapter_id] + [f"{self.adapter_id}.p{i}" for i in range(1, players)]
        self.folder = server.folder / "run" / "adapters" / self.adapter_id
        self.opened: list[str] = []
        self._lock = threading.Lock()

    @property
    def states(self) -> Path:
        return self.folder / "states"

    def player_states(self) -> list[Path]:
        """The states folders of a league's players 1..N-1 (their adapters'), in order."""
        return [self.folder.parent / adapter_id / "states" for adapter_id in self.adapter_ids[1:]]

    def open(self, check: Callable[[], None], seconds: float) -> str:
        """Start the server if needed and open the job's adapters (player 0's from its restored states' folder); the server's URL."""
        config = self.lease["config"]
        if config.get("model") != self.server.spec["model"]:
            raise WorkerFault(f"seat {self.lease.get('seat')} serves {self.server.spec['model']}, not the job's {config.get('model')!r}")
        self.server.ensure(check)
        for index, adapter_id in enumerate(self.adapter_ids):
            token = player_token(self.lease["token"], index)
            body = {"adapter_id": adapter_id, "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                    "lora_rank": config.get("lora_rank") or DEFAULT_LORA_RANK, "lora_alpha": float(config.get("lora_alpha") or DEFAULT_LORA_ALPHA),
                    "seed": (config.get("seed") or 0) + index}
            with self._lock:
                self.server.call("POST", "/v1/adapters", body)
                self.opened.append(adapter_id)
        self.renew(seconds)
        return self.server.url

    def renew(self, seconds: float) -> None:
        """Bind the adapters to the lease for ``seconds`` from now (at the lease's epoch); nothing before they opened."""
        with self._lock:
            for adapter_id in self.opened:
                self.server.call("PUT", f"/v1/adapters/{_q(adapter_id)}/lease", {"seconds": max(seconds, 1e-3), "epoch": self.lease["epoch"]})

    def _mine(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        listing = self.server.call("GET", "/v1/adapters")
        return [a for a in listing.get("adapters", []) if a.get("adapter_id") in self.adapter_ids], listing

    def usage(self) -> tuple[dict[str, int] | None, dict[str, Any] | None]:
        """The tokens the job's adapters trained and sampled (None when none is listed) and the shared server's memory as
        measured now (its listing's ``measured``), for the scheduler's placement of the next seats."""
        mine, listing = self._mine()
        measured = listing.get("measured")
        memory = measured if isinstance(measured, dict) else None
        if not mine:
            return None, memory
        return {k: sum(int(a.get(k) or 0) for a in mine) for k in ("tokens_trained", "tokens_sampled")}, memory

    def idle_s(self) -> float | None:
        """Seconds since the job's client last called one of its adapters (0 while a call runs; None when none is listed)."""
        idle = [float(a["idle_s"]) for a in self._mine()[0] if a.get("idle_s") is not None]
        return min(idle) if idle else None

    def close(self) -> None:
        """Close the adapters (their waiting calls fail, their memory is freed) and delete their folders; safe to call again."""
        with self._lock:
            was_open, self.opened = self.opened, []
        if was_open and self.server.running():
            for adapter_id in was_open:
                try:
                    self.server.call("DELETE", f"/v1/adapters/{_q(adapter_id)}?purge=true")
                except (WorkerFault, JobFault) as exc:
                    log.warning("job %s: could not close its adapter %s: %s", self.lease["job_id"], adapter_id, exc)
        for adapter_id in self.adapter_ids:
            shutil.rmtree(self.folder.parent / adapter_id, ignore_errors=True)
