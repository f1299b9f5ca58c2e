"""A worker's heartbeats sent together: the leases whose heartbeats fall due within a short window are renewed in one
call (``POST /v1/workers/{id}/heartbeats``), not one call each.

Each lease's runner (:class:`tinkergym.scheduler.worker.agent.JobRunner`) still decides when to heartbeat and what to do
with the answer; :meth:`Heartbeats.heartbeat` takes its place in the next batch and returns that lease's answer, or
raises the :class:`~tinkergym.client.SchedulerError` its own call would have raised (404 for a job the scheduler does not
know, 409 for a lease lost: the batched answer's ``lost`` with the same message). The first beat of a batch waits
``window`` seconds for others and sends them all. Since every answer of a batch comes back at once, runners that
heartbeat at the same interval fall into step after their first batch: a worker of 8 leases makes one call an interval.

A scheduler without the batched route (one older than it) answers it 404 or 405: the beats of that batch are sent one
by one, and if those are answered, every later beat goes one by one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from tinkergym.client import SchedulerError

log = logging.getLogger("tinkergym.worker")

#: Seconds the first heartbeat of a batch waits for others (at most a quarter of the shortest heartbeat interval).
WINDOW_S = 0.5


@dataclass
class _Beat:
    client: Any  # the runner's heartbeat client (its retries and timeout): the batch goes on its first beat's
    job_id: str
    epoch: int
    usage: dict[str, int] | None
    memory: dict[str, Any] | None
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None
    error: BaseException | None = None


class Heartbeats:
    """One worker's heartbeats, batched (see the module's notes); safe from any thread."""

    def __init__(self, window: float = WINDOW_S) -> None:
        self.window = window
        self.batched = True  # False once the scheduler is found not to take a worker's heartbeats in one call
        self._lock = threading.Lock()
        self._pending: list[_Beat] | None = None

    def heartbeat(self, client: Any, job_id: str, epoch: int, usage: dict[str, int] | None = None, memory: dict[str, Any] | None = None,
                  window: float | None = None) -> dict[str, Any]:
        """Renew the lease (as ``client.heartbeat`` does: a :class:`WorkerClient`) within the next batch: its answer, or its
        error. ``window``: the most this beat may wait for others (the runner's: a quarter of its interval)."""
        beat = _Beat(client, job_id, epoch, usage, memory)
        if not self.batched:
            return self._one(beat)
        with self._lock:
            leader = self._pending is None
            if leader:
                self._pending = []
            assert self._pending is not None
            self._pending.append(beat)
        if leader:
            threading.Event().wait(min(self.window, window if window is not None else self.window))
            with self._lock:
                batch, self._pending = self._pending or [], None
            self._send(batch)
        beat.done.wait()
        if beat.error is not None:
            raise beat.error
        assert beat.answer is not None
        return beat.answer

    def _one(self, beat: _Beat) -> dict[str, Any]:
        return beat.client.heartbeat(beat.job_id, beat.epoch, beat.usage, beat.memory)

    def _send(self, batch: list[_Beat]) -> None:
        try:
            if self.batched:
                self._together(batch)
            else:
                self._apart(batch)
        except Exception as exc:  # noqa: BLE001 - an answer it cannot read: each beat fails as a call the scheduler did not answer
            for beat in batch:
                if beat.answer is None and beat.error is None:
                    beat.error = SchedulerError(f"heartbeats: {type(exc).__name__}: {exc}")
        finally:
            for beat in batch:
                beat.done.set()

    def _together(self, batch: list[_Beat]) -> None:
        try:
            answers = batch[0].client.heartbeats([{"job_id": b.job_id, "epoch": b.epoch, "usage": b.usage, "memory": b.memory} for b in batch])
        except SchedulerError as exc:
            if exc.status in (404, 405) and self._apart(batch):
                log.info("the scheduler takes no batched heartbeats (%s): each lease heartbeats on its own", exc)
                self.batched = False
            elif exc.status not in (404, 405):
                for beat in batch:
                    beat.error = exc
            return
        by_lease = {(a.get("job_id"), a.get("epoch")): a for a in answers}
        for beat in batch:
            answer = by_lease.get((beat.job_id, beat.epoch))
            if answer is None:
                beat.error = SchedulerError(f"the scheduler's heartbeats answer named no lease {beat.job_id} at epoch {beat.epoch}")
            elif answer.get("lost"):
                why = str(answer.get("error") or f"job {beat.job_id}: the lease at epoch {beat.epoch} is lost")
                not_found = why.startswith("no job ")
                beat.error = SchedulerError(why, 404 if not_found else 409, "not_found" if not_found else "conflict")
            else:
                beat.answer = answer

    def _apart(self, batch: list[_Beat]) -> bool:
        """Each beat on its own call; whether any was answered (the scheduler knows this worker and its leases)."""
        answered = False
        for beat in batch:
            try:
                beat.answer = self._one(beat)
                answered = True
            except SchedulerError as exc:
                beat.error = exc
        return answered
