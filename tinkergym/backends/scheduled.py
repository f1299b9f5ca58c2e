"""ScheduledBackend: the Backend protocol through a scheduler job (``tinkergym train --scheduler URL``).

The client submits a job (or reattaches to one), waits in the queue while the scheduler shows its position,
and once a worker runs the job's training server it talks to that server directly with
:class:`~tinkergym.backends.remote.RemoteBackend` and the token of the lease's epoch; the scheduler never
carries compute traffic. Standard library only, like RemoteBackend: no torch on the client.

When the server goes away (its worker died, the lease expired and the job was queued again), a call fails
with :class:`BackendLost`. :meth:`ScheduledBackend.reconnect` waits for the job's next lease and connects to
the new server; :class:`~tinkergym.trainers.session.TrainingRun` then loads its newest checkpoint that the
new server has (the worker restores checkpoints from the scheduler's artifact store) and goes on from there.
At the end of the run, :meth:`complete` ends the job, which frees its devices at once.
"""

from __future__ import annotations

import math
import time
from typing import Any
from collections.abc import Callable

from tinkergym import timeline
from tinkergym.backends.remote import RemoteBackend, RemoteBackendError, server_name
from tinkergym.client import TERMINAL_STATES as TERMINAL  # noqa: F401 - importable from here
from tinkergym.client import JobEnded, print_stderr  # noqa: F401 - JobEnded: raised by wait_running; importable from here
from tinkergym.errors import ConfigError

#: Seconds :meth:`ScheduledBackend.complete` waits for the worker to store the run's last checkpoint.
STORE_TIMEOUT_S = 600.0


class BackendLost(RemoteBackendError):
    """The job's server stopped answering (lease lost or worker gone); :meth:`ScheduledBackend.reconnect` waits for the next one."""


class ScheduledBackend:
    """The Backend protocol computed by the server of scheduler job ``job_id``.

    Args:
        client: a :class:`tinkergym.client.SchedulerClient`.
        job_id: the job (see :meth:`submit`).
        poll: seconds between looks at a job that is not running yet.
        wait_timeout: seconds to wait for the job to run (None: as long as it takes).
        say: where progress lines go (queue position, connections); default stderr.
        remote: keyword arguments for each :class:`RemoteBackend` (timeouts, retries).
    """

    def __init__(
        self, client: Any, job_id: str, *, poll: float = 1.0, wait_timeout: float | None = None, say: Callable[[str], None] = print_stderr,
        remote: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.poll = poll
        self.wait_timeout = wait_timeout
        self.say = say
        self.remote_options = {"retries": 4, "backoff": 0.5, **(remote or {})}
        self.epoch: int | None = None
        self.last_state: str | None = None  # the name of the state last saved on the job's server
        self._remote: RemoteBackend | None = None

    def __repr__(self) -> str:
        return f"ScheduledBackend({self.client.url!r}, job={self.job_id!r}, epoch={self.epoch})"

    @classmethod
    def submit(cls, client: Any, kind: str, config: dict[str, Any], *, gpus: int = 1, priority: int = 0, name: str = "",
               idempotency_key: str | None = None, **options: Any) -> ScheduledBackend:
        """Queue a job for ``config`` and return its backend (not yet connected: the first call waits for the lease)."""
        job = client.submit(kind, config, gpus=gpus, priority=priority, name=name, idempotency_key=idempotency_key)
        return cls(client, job["id"], **options)

    # ----- the job's lifecycle ------------------------------------------------------------------------
    def wait_running(self, after_epoch: int | None = None) -> dict[str, Any]:
        """Wait until the job runs (at an epoch above ``after_epoch``); its connection (url, token, epoch)."""
        from tinkergym.client import wait_running

        return wait_running(self.client, self.job_id, after_epoch=after_epoch, timeout=self.wait_timeout, poll=self.poll, say=self.say,
                            still_queued="it stays queued: reattach later with tinkergym train --resume")

    def connect(self, after_epoch: int | None = None) -> None:
        """Wait for the job to run and connect to its server (the wait is the run's ``queue`` span)."""
        with timeline.span("queue", "setup", epoch=after_epoch):
            connection = self.wait_running(after_epoch)
        if self._remote is not None:
            self._remote.close()
        self._remote = RemoteBackend(connection["url"], connection["token"], **self.remote_options)
        self.epoch = int(connection["epoch"])
        self.say(f"job {self.job_id}: connected to its server at {connection['url']} (lease epoch {self.epoch})")

    def reconnect(self) -> None:
        """After :class:`BackendLost`: wait for the job's next lease (a new epoch) and connect to that server."""
        self.say(f"job {self.job_id}: its server at epoch {self.epoch} is gone; waiting for the job's next lease")
        self.connect(after_epoch=self.epoch)

    def report_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Send a step's numbers to the job's event stream; a failure to do so never stops the run."""
        from tinkergym.client import SchedulerError

        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        try:
            self.client.report(self.job_id, "metrics", {**numbers, "step": step})  # the run's step wins over the backend's counter
        except (SchedulerError, OSError) as exc:
            self.say(f"job {self.job_id}: could not report step {step}'s metrics to the scheduler ({exc})")

    def complete(self, store_timeout: float = STORE_TIMEOUT_S) -> None:
        """End the job (it succeeds; its devices are freed at once), once the worker has stored its last saved state.

        The worker uploads each state the server saves to the scheduler's artifact store; ending the job stops the
        server, so the run's last checkpoint (the one a later ``--resume`` or ``serve-model --scheduler`` starts
        from) is waited for first, up to ``store_timeout`` seconds.
        """
        if self.epoch is None:
            return
        if self.last_state is not None:
            self._wait_stored(self.last_state, store_timeout)
        self.client.complete(self.job_id, self.epoch)

    def _wait_stored(self, name: str, timeout: float) -> None:
        from tinkergym.client import SchedulerError

        deadline, said = time.monotonic() + timeout, False
        while True:
            try:
                if any(c["name"] == name for c in self.client.checkpoints(self.job_id)):
                    return
            except (SchedulerError, OSError) as exc:
                self.say(f"job {self.job_id}: could not list its checkpoints ({exc})")
                return
            if time.monotonic() > deadline:
                self.say(f"job {self.job_id}: checkpoint {name} was not stored by the worker within {timeout:g} s; ending the job without it")
                return
            if not said:
                self.say(f"job {self.job_id}: waiting for the worker to store checkpoint {name}")
                said = True
            time.sleep(min(self.poll, 0.25))

    # ----- the Backend protocol ---------------------------------------------------------------------
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._remote is None:
            self.connect()
        try:
            return getattr(self._remote, method)(*args, **kwargs)
        except RemoteBackendError as exc:  # no answer after the retries: the server is gone
            raise BackendLost(f"job {self.job_id}: {exc}") from exc
        except ConfigError as exc:
            if "refused the token" in str(exc):  # another server (a new epoch) answers on that address
                raise BackendLost(f"job {self.job_id}: {exc}") from exc
            raise

    def info(self) -> dict[str, Any]:
        return {**self._call("info"), "job_id": self.job_id, "scheduler": self.client.url}

    def ping(self) -> None:
        """Tell the job's server its client is alive (see :meth:`RemoteBackend.ping`); never connects (nothing to keep alive
        before a connection, and a reconnection is the calls' to make)."""
        remote = self._remote
        if remote is None:
            return
        try:
            remote.ping()
        except RemoteBackendError as exc:
            raise BackendLost(f"job {self.job_id}: {exc}") from exc

    def sample(self, request: Any) -> Any:
        return self._call("sample", request)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        return self._call("logprobs", sequences, temperature)

    def forward_backward(self, request: Any) -> Any:
        return self._call("forward_backward", request)

    def optim_step(self, params: Any) -> dict[str, float]:
        return self._call("optim_step", params)

    def save_state(self, path: str) -> None:
        self._call("save_state", path)
        self.last_state = server_name(path)

    def load_state(self, path: str) -> None:
        self._call("load_state", path)

    def export(self, path: str, merged: bool = False) -> None:
        self._call("export", path, merged)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()


def build(request: Any) -> ScheduledBackend:
    """The ``scheduled`` backend plugin: the run's job at ``scheduler_url`` (reattached while it waits or runs), else a
    new job, which starts from the ended one's checkpoints when the run had one."""
    from tinkergym.client import SchedulerClient

    c = request.config
    client = SchedulerClient(c.scheduler_url, request.api_key)
    job_config = c.job_config()
    if c.scheduler_job:
        if client.show(c.scheduler_job)["state"] not in TERMINAL:
            return ScheduledBackend(client, c.scheduler_job)  # reattach: the job waits or runs
        # The job ended (its client went quiet, or the run is extended): a new job starts from its checkpoints.
        job_config["resume_job"] = c.scheduler_job
    kind = "sft" if c.trainer == "sft" else "train"
    return ScheduledBackend.submit(client, kind, job_config, gpus=c.gpus, name=request.name)
