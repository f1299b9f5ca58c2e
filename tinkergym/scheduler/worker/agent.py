"""The worker (``tinkergym worker``): takes leases for its devices and runs each job's server (its own process group, or Ray actors).

Standard library and :mod:`tinkergym.client` only: no torch, no FastAPI (the servers it starts load those).

For each lease, in ``<work-dir>/jobs/<job>/<epoch>/`` (the server's run folder, with the lease's token in the
0600 file ``token`` and the lease's deadline in ``lease``, moved on at every heartbeat the scheduler accepts: past it
the server refuses every call, so a frozen worker's server stops serving when its lease ends), a :class:`JobRunner`:

1. restores checkpoints from the scheduler's artifact store into ``states/<name>`` (sizes and SHA-256 checked):
   the job's last one (the lease's ``checkpoint``) and, for a job whose config continues an ended one
   (``resume_job``), that job's newest, which an inference or eval job serves (``serve model --checkpoint``);
   a scheduler that fails meanwhile (5xx, no answer) is asked again while the lease holds;
2. reports ``starting``, starts ``python -m tinkergym serve backend ... --exit-with-parent`` (``serve model`` for
   inference jobs) through the worker's launcher (:mod:`~tinkergym.scheduler.worker.launchers`: by default a process
   group of this machine that dies with the worker, with ``CUDA_VISIBLE_DEVICES`` set to the leased devices, empty for
   CPU slots; with ``--ray``, one Ray actor per rank: :mod:`~tinkergym.scheduler.worker.ray_pool`), waits for its
   ``/health`` and reports ``running`` with its URL;
3. uploads each new complete state folder the server writes (``states/<name>``, not ``*.tmp``), file by file,
   and only then records the checkpoint (step from ``step_NNNNNN`` or ``state.json``);
4. ends with the job: a server that exits is reported ``failed`` with one line (exit code 75: its client went quiet;
   how to resume is in the error; the log's tail goes to the worker's log); a heartbeat answer ``cancelling`` stops
   the server (SIGTERM, then SIGKILL) and reports ``cancelled``; a heartbeat refused with 409 (the lease expired,
   moved on, or the client completed the job: then it is no warning) kills the process group at once. A lease that
   could not be renewed for its whole TTL (the scheduler unreachable) is treated as lost too: the server stops
   before another worker's can start. A server gone without an exit code of its own (its Ray actor or node died) is
   stopped and its lease left to expire, so the job is queued again and resumes from its last checkpoint.

A server that cannot run here (:mod:`~tinkergym.scheduler.worker.checks`) or the worker's own fault (disk, port) gives the
job back at the same attempt, quarantining the worker; only the job's faults fail it. :mod:`.worker_folders` bounds disk.

A heartbeat thread per job renews the lease every ``heartbeat`` seconds (default a third of the TTL) while the
job's thread restores, starts, uploads. SIGTERM or SIGINT stops every server and the worker; their leases
expire and the jobs are queued again.

A seat lease (a LoRA job packed onto a shared training server: :mod:`~tinkergym.scheduler.worker.seats`) runs the
same steps with the job's adapter on the device's shared server in place of a server of its own: its states are
restored into and uploaded from the adapter's folder, each renewal moves the adapter's lease too, an idle client
ends it as an idle server would, and its end closes the adapter. The loop that asks for leases is
:class:`~tinkergym.scheduler.worker.pool.Worker`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from tinkergym.scheduler.artifact_paths import check_relpath
from tinkergym.scheduler.worker.job_servers import SERVING_KINDS, WorkerOptions, die_with_parent, server_command  # noqa: F401 - public here too
from tinkergym.scheduler.worker.checks import last_line, log_tail, server_fault
from tinkergym.scheduler.worker.faults import Cancelled, JobFault, LeaseLost, Shutdown, WorkerFault  # noqa: F401 - public here too
from tinkergym.scheduler.worker.folders import PLAYER_STATE, finish_folder, prune_states, state_files, state_step
from tinkergym.scheduler.worker.launchers import STOP_GRACE_S, JobServer, ServerLost  # noqa: F401 - STOP_GRACE_S public here too
from tinkergym.scheduler.worker.seats import Seat

from tinkergym.serve.auth import write_lease_file
from tinkergym.client import SchedulerError
from tinkergym.plumbing.folders import write_private_file

log = logging.getLogger("tinkergym.worker")

#: Exit codes of ``serve backend`` (``tinkergym.serve.lifetime``, not imported here to keep this light).
IDLE_EXIT_CODE = 75
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
#: A 409's message when the job itself ended at this epoch (its client completed it, it was cancelled or failed).
ENDED = re.compile(r"the job is (succeeded|failed|cancelled) at epoch (\d+)")
START_TIMEOUT_S = 900.0
#: Seconds a heartbeat waits for the server's token counts (it goes without them past this).
USAGE_TIMEOUT_S = 1.0
LOG_TAIL = 3000


class JobRunner(threading.Thread):
    """One lease: restore, start the server, report, heartbeat, upload checkpoints, stop (see the module's notes)."""

    def __init__(self, worker: Any, lease: dict[str, Any]) -> None:
        super().__init__(name=f"job-{lease['job_id']}", daemon=True)
        self.worker, self.lease, self.options = worker, lease, worker.options
        self.job_id, self.epoch, self.devices = lease["job_id"], int(lease["epoch"]), list(lease["devices"])
        self.ttl = float(lease["ttl_s"])
        self.interval = self.options.heartbeat or self.ttl / 3
        self.client = worker.client.copy()
        self.beats = worker.client.copy(retries=1, backoff=min(0.2, self.interval / 4), timeout=max(1.0, self.interval))
        self.folder = self.options.work_dir / "jobs" / self.job_id / str(self.epoch)
        self.server: JobServer | None = None  # started by the worker's launcher (tinkergym.scheduler.worker.launchers)
        self.lost, self.cancelling, self.shutdown, self.done = threading.Event(), threading.Event(), threading.Event(), threading.Event()
        self.beat_now = threading.Event()  # wakes the heartbeat thread before its interval: the server came up, or the lease ended
        self.renewed_at = time.monotonic()
        self.lost_why = "not renewed"
        self._lease_lock = threading.Lock()
        self.seen: dict[str, tuple[int, int]] = {}
        self.recorded: set[str] = set()
        self.outcome = "running"
        self.served: str | None = None  # the restored checkpoint an inference job serves
        # A seat lease runs as an adapter of the device's shared server (worker.seats), not as a server of its own.
        shared = worker.shared.servers.get(self.devices[0]) if lease.get("seat") is not None and self.devices else None
        self.seat = Seat(shared, lease) if shared is not None else None
        self.states = self.seat.states if self.seat is not None else self.folder / "states"
        # a league's players 1..N-1 save theirs (step_N.p<i>) beside their own adapters: uploaded and restored as checkpoints too
        self.player_states = self.seat.player_states() if self.seat is not None else []
        self.places = ({("seat", i) for i in lease.get("seats") or [lease["seat"]]} if lease.get("seat") is not None
                       else {("device", i) for i in self.devices})

    # ----- the job ----------------------------------------------------------------------------------
    def run(self) -> None:
        beats = threading.Thread(target=self._heartbeats, name=f"heartbeat-{self.job_id}", daemon=True)
        beats.start()
        try:
            self._run()
        except LeaseLost as exc:
            ended = self._ended_as(str(exc))
            self.outcome = ended or "lost"
            if ended is None:
                log.warning("job %s epoch %s: the lease is lost (%s); its server is stopped", self.job_id, self.epoch, exc)
        except Cancelled:
            self._stop_server(graceful=True)
            self.outcome = "cancelled"
            self._try_report("cancelled")
        except Shutdown:
            self.outcome = "shutdown"
        except ServerLost as exc:  # its Ray actor or node died: the lease ends as if the worker had died with it
            self._server_lost(str(exc))
        except (WorkerFault, OSError) as exc:  # this machine's fault: the job goes back to the queue, not counted
            self._stop_server(graceful=False)
            self._give_back(str(exc) if isinstance(exc, WorkerFault) else f"{type(exc).__name__}: {exc}")
        except JobFault as exc:
            self._stop_server(graceful=False)
            self.outcome = "failed"
            self._try_report("failed", error=str(exc))
        except Exception as exc:
            log.exception("job %s epoch %s failed in the worker", self.job_id, self.epoch)  # the traceback stays here
            self._stop_server(graceful=False)
            self.outcome = "failed"
            first = (str(exc).strip().splitlines() or [""])[0]
            self._try_report("failed", error=f"the worker could not run the job: {type(exc).__name__}: {first}")
        finally:
            self._stop_server(graceful=self.outcome in ("cancelled", "shutdown"))
            self.done.set()
            self.beat_now.set()
            try:
                finish_folder(self.folder, self.outcome)
            except OSError as exc:
                log.warning("job %s: could not clean its folder %s: %s", self.job_id, self.folder, exc)
            beats.join(timeout=5)
            self.client.close()
            self.beats.close()
            self.worker.finished(self)

    def _ended_as(self, message: str) -> str | None:
        """The job's end state when a 409 says the job itself ended at this epoch (no fault: its client completed it,
        or it was cancelled), else None."""
        match = ENDED.search(message)
        return match.group(1) if match and int(match.group(2)) == self.epoch else None

    def _give_back(self, reason: str) -> None:
        """Release the job (queued again at the same attempt); the scheduler quarantines this worker for ``reason``."""
        self.outcome = "released"
        reason = " ".join(reason.split())[:1000]
        log.error("job %s epoch %s: this worker cannot run it (%s); it is given back, this worker quarantined", self.job_id, self.epoch, reason)
        try:
            self.client.release(self.job_id, self.epoch, reason)
        except SchedulerError as exc:
            log.warning("job %s: could not give it back (%s); its lease expires instead", self.job_id, exc)

    def _run(self) -> None:
        if self.lease.get("seat") is not None and self.seat is None:
            raise WorkerFault(f"the scheduler leased seat {self.lease['seat']} of device {self.devices}, which this worker does not run as "
                              "a shared server; register the worker again")
        self.folder.mkdir(parents=True, exist_ok=True)
        write_private_file(self.folder / "token", self.lease["token"] + "\n")
        self._renewed(self.renewed_at)
        self._restore_while_leased()
        self._report("starting")
        self._event("log", {"message": f"starting its server on worker {self.options.name}: loading {self.lease['config'].get('model')}"})
        url = self.seat.open(self._check, self._lease_left()) if self.seat is not None else self._start_server()
        self._report("running", server_url=url)
        self.beat_now.set()  # a heartbeat at once: the scheduler counts a lease as run from the first heartbeat after "running"
        self._event("log", {"message": f"server running at {url} on worker {self.options.name}", "devices": self.devices})
        next_scan = 0.0
        while True:
            self._check()
            code = self.server.exit_code() if self.server is not None else None
            if code is not None:
                self._scan()
                self._ended(code)
                return
            if time.monotonic() >= next_scan:
                self._scan()
                next_scan = time.monotonic() + 0.5
                if self.seat is not None and self._seat_ended():
                    return
            time.sleep(0.1)

    def _seat_ended(self) -> bool:
        """Whether the seat's job ended: its client idle past the idle timeout (failed as a whole server's would be).
        The shared server's exit is this machine's fault (:class:`WorkerFault`)."""
        assert self.seat is not None
        code = self.seat.server.exit_code()
        if code is not None:
            raise WorkerFault(f"the shared server of device {self.devices[0]} exited with code {code}: "
                              f"{last_line(self.seat.server.log_tail(), 'no log')}")
        idle = self.options.idle_timeout or self.lease.get("idle_timeout_s")
        if not idle or (self.seat.idle_s() or 0.0) < idle:
            return False
        self._scan()
        self._ended(IDLE_EXIT_CODE)
        return True

    def _exit_code(self, code: int) -> int:
        """The server's own exit code: a sharded server's rank 0 writes it to ``exit-code`` (torchrun exits 1 for any failure)."""
        try:
            return int((self.folder / "exit-code").read_text().strip())
        except (OSError, ValueError):
            return code

    def _server_lost(self, why: str) -> None:
        """The server is gone without an exit code of its own (:class:`ServerLost`): what it saved is uploaded, the rest of
        it stopped, and the lease left to expire (no more heartbeats), so the job is queued again and resumes from its last
        checkpoint on its next lease, as when a whole worker dies (its expiry counts an attempt); nothing is reported, and this
        worker is not quarantined: the actor's or node's death is no fault of the job's, nor proof that the cluster cannot run it."""
        self.outcome = "lost"
        log.warning("job %s epoch %s: %s; what is left of its server is stopped and its lease left to expire, so the job is queued "
                    "again", self.job_id, self.epoch, why)
        self._stop_server(graceful=False)
        try:
            self._scan()
        except Exception as exc:  # noqa: BLE001 - the lease ends either way; its last checkpoint is the one uploaded before
            log.warning("job %s: its last states were not uploaded: %s", self.job_id, exc)
        self._event("log", {"message": f"{why}: the job's server is stopped; the job is queued again when this lease ends "
                                       f"(within {self.ttl:g}s) and resumes from its last checkpoint"})

    def _ended(self, code: int) -> None:
        """The server exited on its own: the job failed (an idle client says how to resume)."""
        self._release_server()
        code = self._exit_code(code)
        if code == IDLE_EXIT_CODE and self.lease["kind"] in SERVING_KINDS:
            error = ("the job's inference server got no request for the idle timeout, so it stopped (exit code 75) and the devices are "
                     "free; serve the model again with: tinkergym serve model --scheduler URL (the same --run or --model)")
        elif code == IDLE_EXIT_CODE and (self.lease.get("config") or {}).get("trainer") == "tinker":
            error = ("the job's Tinker front door (serve tinker --scheduler) sent no call for the idle timeout (it stopped, or lost the "
                     "session), so its server stopped (exit code 75) and the devices are free; its stored states are kept: a Tinker client "
                     "resumes the run from one with create_training_client_from_state(path) through the front door")
        elif code == IDLE_EXIT_CODE:
            error = ("the job's client sent no call for the idle timeout, so its server stopped (exit code 75) and the devices are free; "
                     "continue the run with: tinkergym train --resume DIR (the run's folder), which starts from its last checkpoint")
        else:
            tail = self._log_tail()
            fault = server_fault(code, tail)
            if fault is not None:
                raise WorkerFault(f"the job's server exited with code {code}: {fault}")
            log.warning("job %s: its server exited with code %s; the end of its log:\n%s", self.job_id, code, tail)
            error = f"the job's server exited with code {code}: {last_line(tail, 'no log')}"
        self.outcome = "failed"
        self._report("failed", error=error)

    def _check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(self.lost_why)
        if self.shutdown.is_set():
            raise Shutdown()
        if self.cancelling.is_set():
            raise Cancelled()

    # ----- scheduler calls --------------------------------------------------------------------------
    def _conflict(self, exc: SchedulerError) -> None:
        """After a 404/409, a heartbeat says why: the lease is lost (:class:`LeaseLost`), the job is cancelling
        (:class:`Cancelled`), or neither, and the refusal was about the request itself (returns)."""
        sent = time.monotonic()
        try:
            answer = self.beats.heartbeat(self.job_id, self.epoch)
        except SchedulerError as beat:
            if beat.status in (404, 409):
                self._lose(str(beat))
                raise LeaseLost(str(beat)) from exc
            raise exc from beat
        self._renewed(sent)
        if answer.get("cancelling"):
            self.cancelling.set()
            raise Cancelled() from exc

    def _report(self, state: str, **extra: Any) -> None:
        try:
            self.client.report_state(self.job_id, self.epoch, state, **extra)
        except SchedulerError as exc:
            if exc.status in (404, 409):
                self._conflict(exc)
            raise

    def _try_report(self, state: str, **extra: Any) -> None:
        try:
            self.client.report_state(self.job_id, self.epoch, state, **extra)
        except SchedulerError as exc:
            log.warning("job %s: could not report %s: %s", self.job_id, state, exc)

    def _event(self, type_: str, data: dict[str, Any]) -> None:
        try:
            self.client.event(self.job_id, self.epoch, type_, data)
        except SchedulerError as exc:
            log.warning("job %s: could not report an event: %s", self.job_id, exc)

    def _usage(self) -> tuple[dict[str, int] | None, dict[str, Any] | None]:
        """What the job's server (or adapter) trained and sampled so far at this lease, for the tenant's usage, and the
        server's memory measured now (a seat's: its shared server's), for placement; None each when it cannot say now
        (starting, or busy past the short wait): the next heartbeat reports them."""
        try:
            if self.seat is not None:
                return self.seat.usage() if self.seat.opened else (None, None)
            server = self.server
            if server is None:
                return None, None
            conn = http.client.HTTPConnection(server.host, server.port, timeout=USAGE_TIMEOUT_S)
            try:
                conn.request("GET", "/v1/usage", headers={"Authorization": f"Bearer {self.lease['token']}"})
                response = conn.getresponse()
                body = response.read()
            finally:
                conn.close()
            if response.status != 200:
                return None, None
            answer = json.loads(body)
            memory = answer.get("memory")
            return {k: int(answer[k]) for k in ("tokens_trained", "tokens_sampled")}, memory if isinstance(memory, dict) else None
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, WorkerFault, JobFault, ServerLost):
            return None, None

    def _heartbeats(self) -> None:
        while True:
            self.beat_now.wait(self.interval)
            self.beat_now.clear()
            if self.done.is_set():
                return
            try:
                usage, memory = self._usage()
                sent = time.monotonic()
                answer = self._beat(usage, memory)
                self._renewed(sent)
                if answer.get("cancelling"):
                    self.cancelling.set()
            except SchedulerError as exc:
                if exc.status in (404, 409):
                    ended = self._ended_as(str(exc))
                    (log.info if ended else log.warning)("job %s epoch %s: heartbeat refused (%s)", self.job_id, self.epoch,
                                                         f"the job is {ended}" if ended else exc)
                    self._lose(str(exc))
                    return
                log.warning("job %s: heartbeat failed: %s", self.job_id, exc)
            if time.monotonic() - self.renewed_at > self.ttl:
                log.warning("job %s epoch %s: not renewed for the lease's %gs", self.job_id, self.epoch, self.ttl)
                self._lose()
                return

    def _beat(self, usage: dict[str, int] | None, memory: dict[str, Any] | None) -> dict[str, Any]:
        """One heartbeat: in the worker's next batch with its other leases' (:mod:`tinkergym.scheduler.worker.beats`)."""
        together = getattr(self.worker, "heartbeats", None)
        if together is None:
            return self.beats.heartbeat(self.job_id, self.epoch, usage, memory)
        return together.heartbeat(self.beats, self.job_id, self.epoch, usage, memory, window=self.interval / 4)

    def _renewed(self, sent: float) -> None:
        """The scheduler renewed the lease by a call sent at ``sent`` (monotonic): it ends no sooner than ``sent + ttl``,
        the deadline the server reads from its lease file."""
        with self._lease_lock:
            self.renewed_at = max(self.renewed_at, sent)
            if not self.lost.is_set():
                write_lease_file(self.folder / "lease", self.renewed_at + self.ttl, self.epoch)
        if self.seat is not None and not self.lost.is_set():
            try:
                self.seat.renew(self._lease_left())
            except (WorkerFault, JobFault) as exc:
                log.warning("job %s: could not renew its adapter's lease on the shared server: %s", self.job_id, exc)
        server = self.server
        if server is not None and not self.lost.is_set():
            try:
                server.renew(self._lease_left())
            except Exception as exc:  # noqa: BLE001 - a server that cannot be told is seen gone by the job's thread
                log.warning("job %s: could not renew its server's lease: %s", self.job_id, exc)

    def _lease_left(self) -> float:
        """Seconds until the lease's end as this worker knows it (the last renewal's send time plus the TTL)."""
        return self.renewed_at + self.ttl - time.monotonic()

    def _lose(self, why: str = "not renewed") -> None:
        self.lost_why = why
        self.lost.set()
        self._kill()
        if self.seat is not None:
            self.seat.close()

    # ----- the server -------------------------------------------------------------------------------
    def _start_server(self) -> str:
        """Start the job's server with the worker's launcher (:mod:`~tinkergym.scheduler.worker.launchers`); its URL once it answers."""
        for _attempt in range(3):
            self.server = self.worker.launcher.launch(self)
            try:
                url = self._wait_healthy(self.server)
            finally:
                if self.server is not None:
                    self.server.started()
            if url is not None:
                return url
        raise WorkerFault(f"the job's server could not bind a port in {self.options.ports[0]}-{self.options.ports[1]}: "
                          f"{last_line(self._log_tail(), 'no log')}")

    def _wait_healthy(self, server: JobServer) -> str | None:
        """The server's URL once ``/health`` answers; None when it exited because its port was taken."""
        deadline = time.monotonic() + START_TIMEOUT_S
        host = f"[{server.host}]" if ":" in server.host else server.host
        while time.monotonic() < deadline:
            self._check()
            code = server.exit_code()
            if code is not None:
                code = self._exit_code(code)
                tail = self._log_tail()
                self._release_server()
                if "address already in use" in tail.lower() and code != 0:
                    return None
                fault = server_fault(code, tail)
                if fault is not None:
                    raise WorkerFault(f"the job's server exited with code {code} while starting: {fault}")
                log.warning("job %s: its server exited with code %s while starting; the end of its log:\n%s", self.job_id, code, tail)
                raise JobFault(f"the job's server exited with code {code} while starting: {last_line(tail, 'no log')}")
            try:
                conn = http.client.HTTPConnection(server.host, server.port, timeout=2)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    return f"http://{host}:{server.port}"
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the job's server did not answer /health within {START_TIMEOUT_S:g}s; the end of its log:\n{self._log_tail()}")

    def _release_server(self) -> None:
        """The server exited on its own: free what it held (a Ray placement group, ports) and forget it."""
        server, self.server = self.server, None
        if server is not None:
            server.stop(graceful=False)

    def _kill(self) -> None:
        server = self.server
        if server is not None:
            server.kill()

    def _stop_server(self, graceful: bool) -> None:
        """Stop the server: SIGTERM and a grace period when ``graceful``, then SIGKILL (a seat: close its adapter)."""
        if self.seat is not None:
            self.seat.close()
        server, self.server = self.server, None
        if server is not None:
            server.stop(graceful)

    def _log_tail(self) -> str:
        return log_tail(self.folder / "server.out", LOG_TAIL)

    # ----- checkpoints ------------------------------------------------------------------------------
    def _restore_while_leased(self) -> None:
        """:meth:`_restore`, tried again while the scheduler is away (its 5xx, no answer) and the lease holds."""
        delay = 0.5
        while True:
            try:
                self._restore()
                return
            except SchedulerError as exc:
                if exc.status in (404, 409):
                    self._conflict(exc)
                    raise
                if exc.status is not None and exc.status < 500:
                    raise
                log.warning("job %s: restoring its checkpoints failed (%s); trying again in %.1fs", self.job_id, exc, delay)
            time.sleep(delay)
            self._check()  # the heartbeats end the lease once the scheduler has been away for its TTL
            delay = min(delay * 2, 10.0)

    def _restore(self) -> None:
        """Download the checkpoints a new server starts from into ``states/<name>``."""
        found = self.client.restorable(self.job_id, self.epoch)
        own = [c for c in found if c["job_id"] == self.job_id]
        self.recorded = {c["name"] for c in own}
        chosen: dict[str, dict[str, Any]] = {}
        continued = every = [c for c in found if c["job_id"] != self.job_id]
        config = self.lease.get("config") or {}
        wanted = config.get("resume_checkpoint")
        if wanted:  # a named checkpoint of the continued job (a Tinker sampler's snapshot, a run created from a state)
            continued = [c for c in continued if c["name"] == wanted]
            if not continued:
                raise ValueError(f"job {config.get('resume_job')} has no checkpoint named {wanted!r} to start from")
        elif self.player_states:  # a league's players' states (step_N.p<i>) only beside p0's: its newest is its player 0's
            continued = [c for c in continued if not PLAYER_STATE.match(c["name"])]
        if continued:
            newest = max(continued, key=lambda c: c["step"])
            chosen[newest["name"]] = newest
            self.served = newest["name"]
        named = (self.lease.get("checkpoint") or {}).get("name")
        # a league's players' states (a continued league's, then the job's own): restored beside their players' adapters
        players = {c["name"]: c for c in [*every, *own] if PLAYER_STATE.match(c["name"])} if self.player_states else {}
        own = [c for c in own if c["name"] not in players]
        owner = PLAYER_STATE.match(named) if isinstance(named, str) and named in players else None
        if owner is not None:
            named = owner.group(1)  # the checkpoint the player's state belongs to
        mine = [c for c in own if c["name"] == named] or ([max(own, key=lambda c: c["step"])] if own else [])
        for checkpoint in mine:
            chosen[checkpoint["name"]] = checkpoint
        places = {name: self.states for name in chosen}
        for name in list(chosen):
            for index, folder in enumerate(self.player_states, start=1):
                player = players.get(f"{name}.p{index}")
                if player is not None:
                    chosen[player["name"]], places[player["name"]] = player, folder
        for name, checkpoint in chosen.items():
            states = places[name]
            self._check()
            if not CHECKPOINT_NAME.match(name) or name.endswith(".tmp"):
                continue
            tmp = states / f"{name}.restore.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for entry in self.client.listing(self.job_id, self.epoch, name, checkpoint["job_id"]):
                parts = check_relpath(entry["path"])  # the store's own rule: whatever is listed lands inside tmp
                self.client.download(self.job_id, self.epoch, name, entry["path"], tmp.joinpath(*parts),
                                     int(entry["size"]), str(entry["sha256"]), checkpoint["job_id"])
            final = states / name
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            info = final.stat()
            self.seen[name] = (info.st_ino, info.st_mtime_ns)
            self._event("log", {"message": f"restored checkpoint {name} (step {checkpoint['step']}) of job {checkpoint['job_id']}"})

    def _scan(self) -> None:
        """Upload every new complete state folder (the job's, and a league's players'), then record it."""
        for states in [self.states, *self.player_states]:
            self._scan_folder(states)

    def _scan_folder(self, states: Path) -> None:
        if not states.is_dir():
            return
        for entry in sorted(os.scandir(states), key=lambda e: e.name):
            name = entry.name
            if name.endswith(".tmp") or not CHECKPOINT_NAME.match(name) or entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                continue
            info = entry.stat(follow_symlinks=False)
            signature = (info.st_ino, info.st_mtime_ns)
            if self.seen.get(name) == signature:
                continue
            self._check()
            if name in self.recorded:
                self.seen[name] = signature
                self._event("log", {"message": f"state {name} was saved again; checkpoint {name} is already recorded and is kept as it was"})
                continue
            step = state_step(name, Path(entry.path))
            if step is None:
                self.seen[name] = signature
                continue
            try:
                self._upload(name, Path(entry.path), step)
            except (FileNotFoundError, NotADirectoryError):
                continue  # the folder was being replaced: the next scan sends the new one
            except SchedulerError as exc:
                log.warning("job %s: checkpoint %s not uploaded: %s", self.job_id, name, exc)
                if exc.status is None or exc.status >= 500:
                    continue  # the scheduler is away: the next scan tries again
                self._event("error", {"message": f"checkpoint {name} was not stored: {exc}"[:2000]})
            self.seen[name] = signature
        for name in prune_states(states, self.recorded, self.options.keep_states, {self.served} if self.served else set()):
            self.seen.pop(name, None)  # uploaded and recorded: the scheduler keeps it

    def _upload(self, name: str, folder: Path, step: int) -> None:
        try:
            self.client.drop_partial(self.job_id, self.epoch, name)
            for relpath in state_files(folder):
                self._check()
                self.client.upload(self.job_id, self.epoch, name, relpath, folder.joinpath(*relpath.split("/")))
            self.client.record_checkpoint(self.job_id, self.epoch, step, name)
        except SchedulerError as exc:
            if exc.status in (404, 409):
                self._conflict(exc)  # returns when the lease holds: the refusal is about this checkpoint
            raise
        self.recorded.add(name)
        log.info("job %s: checkpoint %s (step %d) uploaded and recorded", self.job_id, name, step)
