"""The worker agent's heartbeats sent together (``tinkergym.scheduler.worker.beats``): the batching and the mapping of a
batched answer onto each lease's own, against a stand-in of the worker's HTTP client that records its calls (the real
client and scheduler: ``tests/scheduler/test_worker.py::test_a_worker_fills_its_slots_in_one_request_and_heartbeats_them_together``)."""

from __future__ import annotations

import threading
from typing import Any

from tinkergym.client import SchedulerError
from tinkergym.scheduler.worker.beats import Heartbeats


class Recorder:
    """Answers heartbeats as the scheduler would for the leases in ``held``; records every call."""

    def __init__(self, held: dict[str, int], batched: bool = True, garbage: bool = False) -> None:
        self.held, self.batched, self.garbage = held, batched, garbage
        self.calls: list[tuple[str, list[str]]] = []
        self.lock = threading.Lock()

    def _answer(self, job_id: str, epoch: int) -> dict[str, Any]:
        if job_id not in self.held:
            return {"job_id": job_id, "epoch": epoch, "lost": True, "error": f"no job {job_id}"}
        if self.held[job_id] != epoch:
            return {"job_id": job_id, "epoch": epoch, "lost": True, "error": f"job {job_id}: lease epoch {epoch} is stale"}
        return {"job_id": job_id, "epoch": epoch, "state": "running", "cancelling": False, "expires_at": 1.0}

    def heartbeats(self, beats: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with self.lock:
            self.calls.append(("batch", [b["job_id"] for b in beats]))
        if not self.batched:
            raise SchedulerError("Not Found", 404, "not_found")
        if self.garbage:
            raise KeyError("leases")
        return [self._answer(b["job_id"], b["epoch"]) for b in reversed(beats)]  # in any order

    def heartbeat(self, job_id: str, epoch: int, usage: Any = None, memory: Any = None) -> dict[str, Any]:
        with self.lock:
            self.calls.append(("one", [job_id]))
        answer = self._answer(job_id, epoch)
        if answer.get("lost"):
            raise SchedulerError(answer["error"], 404 if answer["error"].startswith("no job") else 409)
        return answer


def _together(beats: Heartbeats, client: Recorder, leases: dict[str, int]) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def beat(job_id: str) -> None:
        try:
            got[job_id] = beats.heartbeat(client, job_id, leases[job_id], window=0.2)
        except SchedulerError as exc:
            got[job_id] = exc

    threads = [threading.Thread(target=beat, args=(j,)) for j in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return got


def test_beats_at_the_same_time_go_in_one_call_each_with_its_own_answer() -> None:
    client = Recorder({"a": 1, "b": 2, "c": 3})
    got = _together(Heartbeats(), client, {"a": 1, "b": 2, "c": 3, "gone": 1})
    assert [kind for kind, _ in client.calls] == ["batch"] and sorted(client.calls[0][1]) == ["a", "b", "c", "gone"]
    assert {j: got[j]["epoch"] for j in ("a", "b", "c")} == {"a": 1, "b": 2, "c": 3}
    assert isinstance(got["gone"], SchedulerError) and got["gone"].status == 404, "a job the scheduler does not know: 404"


def test_a_lost_lease_raises_409_as_its_own_call_would() -> None:
    client = Recorder({"a": 1, "b": 5})
    got = _together(Heartbeats(), client, {"a": 1, "b": 2})
    assert got["a"]["state"] == "running"
    assert isinstance(got["b"], SchedulerError) and got["b"].status == 409 and "stale" in str(got["b"])


def test_a_scheduler_without_the_route_is_heartbeaten_lease_by_lease() -> None:
    client = Recorder({"a": 1, "b": 1}, batched=False)
    beats = Heartbeats()
    got = _together(beats, client, {"a": 1, "b": 1})
    assert {j: got[j]["state"] for j in got} == {"a": "running", "b": "running"} and beats.batched is False
    client.calls.clear()
    assert beats.heartbeat(client, "a", 1)["state"] == "running" and client.calls == [("one", ["a"])]


def test_an_answer_it_cannot_read_fails_each_beat_as_an_unanswered_call() -> None:
    client = Recorder({"a": 1, "b": 1}, garbage=True)
    got = _together(Heartbeats(), client, {"a": 1, "b": 1})
    assert all(isinstance(got[j], SchedulerError) and got[j].status is None and "KeyError" in str(got[j]) for j in ("a", "b"))

