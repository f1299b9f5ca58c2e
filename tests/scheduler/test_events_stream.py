"""The job event stream (server-sent events) against a live uvicorn server, and SchedulerClient.follow's reconnection."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from sqlalchemy import delete, func, insert, select, update
from tinkergym.scheduler import states
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import idempotency, jobs, make_engine
from tinkergym.scheduler.idempotency import IN_FLIGHT, fingerprint
from tinkergym.scheduler.repository import JobStore

from tinkergym.serve.asgi import ThreadServer
from tinkergym.client import SchedulerClient, SchedulerError

CONFIG = {"model": "smollm2-135m", "env": "tinker/Bandit-v0"}


class DropProxy:
    """A TCP proxy in front of ``port`` whose :meth:`drop` cuts every open connection (a network blip)."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        self.lose_answers = 0  # answers to drop on their way back (the request has reached the server)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _lose_answer(self) -> bool:
        with self.lock:
            if self.lose_answers > 0:
                self.lose_answers -= 1
                return True
            return False

    def _pump(self, source: socket.socket, dest: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if answers and self._lose_answer():
                    break  # the connection closes without the answer
                dest.sendall(data)
        except OSError:
            pass
        for s in (source, dest):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop(self) -> int:
        """Cut every connection open now; how many there were."""
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        return len(cut) // 2

    def close(self) -> None:
        self.listener.close()
        self.drop()


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[ThreadServer]:
    settings = SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sse_keepalive_s=0.2)
    live = ThreadServer(create_app(settings, background=False))
    yield live
    live.stop()


@pytest.fixture
def store(db_url: str, server: ThreadServer) -> Iterator[JobStore]:
    """A JobStore on the server's database (the test's own engine: writes as a worker's request would)."""
    engine = make_engine(db_url)
    yield JobStore(engine)
    engine.dispose()


def submit(url: str, key: str) -> str:
    return SchedulerClient(url, key).submit("train", CONFIG)["id"]


def append(store: JobStore, job_id: str, n: int = 1, type_: str = "log") -> list[int]:
    seqs = []
    for i in range(n):
        with store.transaction() as conn:
            seqs.append(store.append_event(conn, job_id, type_, {"line": f"line {i}"}))
    return seqs


def finish(store: JobStore, job_id: str) -> int:
    """Move a queued job to cancelled (terminal); the seq of that state event."""
    with store.transaction() as conn:
        return store.transition(conn, job_id, states.CANCELLED).event_seq


class RawStream:
    """One SSE connection read line by line: messages as (id, event, data) and comments, with arrival times."""

    def __init__(self, url: str, key: str, job_id: str, last_event_id: str | None = None, query: str = "") -> None:
        port = int(url.rsplit(":", 1)[1])
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.conn.request("GET", f"/v1/jobs/{job_id}/events/stream{query}", headers=headers)
        self.response = self.conn.getresponse()

    def next(self) -> tuple[str, Any]:
        """("event", {"id", "event", "data"}) or ("comment", text) or ("eof", None): the next item on the stream."""
        fields: dict[str, str] = {}
        while True:
            line = self.response.readline()
            if not line:
                return ("eof", None)
            text = line.decode().rstrip("\n")
            if text.startswith(":"):
                return ("comment", text[1:].strip())
            if not text:
                if "data" in fields:
                    return ("event", {**fields, "data": json.loads(fields["data"])})
                fields = {}
                continue
            name, _, value = text.partition(": ")
            fields[name] = value

    def next_event(self) -> dict[str, Any] | None:
        while True:
            kind, item = self.next()
            if kind == "event":
                return item
            if kind == "eof":
                return None

    def close(self) -> None:
        self.conn.close()


def test_stream_sends_the_backlog_then_a_new_event_within_a_second(server, store, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    stream = RawStream(server.url, key, job_id)
    assert stream.response.status == 200
    assert stream.response.getheader("content-type").startswith("text/event-stream")
    first = stream.next_event()
    assert first["id"] == "1" and first["event"] == "state" and first["data"]["data"]["state"] == "queued"
    for _ in range(3):
        time.sleep(0.3)  # the stream is idle and polling
        t0 = time.monotonic()
        [seq] = append(store, job_id)
        event = stream.next_event()
        assert time.monotonic() - t0 < 1.0
        assert event["id"] == str(seq) and event["event"] == "log" and event["data"]["seq"] == seq
    stream.close()


def test_keep_alive_comments_arrive_while_idle(server, store, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    stream = RawStream(server.url, key, job_id)
    assert stream.next_event()["id"] == "1"
    t0, comments = time.monotonic(), []
    while len(comments) < 3:
        kind, item = stream.next()
        assert kind == "comment", (kind, item)
        comments.append(item)
    assert comments == ["keep-alive"] * 3
    assert time.monotonic() - t0 < 3.0  # interval 0.2 s
    stream.close()


def test_last_event_id_and_after_resume_without_loss_or_duplicates(server, store, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    append(store, job_id, 9)  # seqs 2..10
    stream = RawStream(server.url, key, job_id)
    got = [int(stream.next_event()["id"]) for _ in range(4)]
    stream.close()
    # Events written while nobody listens, then resume from the last id seen.
    append(store, job_id, 5)  # 11..15
    stream = RawStream(server.url, key, job_id, last_event_id=str(got[-1]))
    got += [int(stream.next_event()["id"]) for _ in range(15 - got[-1])]
    stream.close()
    assert got == list(range(1, 16))
    # ?after= works the same; Last-Event-ID wins when both are given.
    stream = RawStream(server.url, key, job_id, query="?after=12")
    assert stream.next_event()["id"] == "13"
    stream.close()
    stream = RawStream(server.url, key, job_id, last_event_id="14", query="?after=2")
    assert stream.next_event()["id"] == "15"
    stream.close()


def test_resume_under_concurrent_writes_loses_and_repeats_nothing(server, store, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    done = threading.Event()

    def writer() -> None:
        for _ in range(60):
            append(store, job_id)
            time.sleep(0.005)
        finish(store, job_id)
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    got: list[int] = []
    last: str | None = None
    ended = False
    while not ended:
        stream = RawStream(server.url, key, job_id, last_event_id=last)
        for _ in range(7):  # read a few, then drop the connection
            event = stream.next_event()
            if event is None:
                ended = True
                break
            got.append(int(event["id"]))
            last = event["id"]
            if event["event"] == "state" and event["data"]["data"]["state"] == "cancelled":
                ended = stream.next_event() is None  # the stream closes after the terminal event
                assert ended
                break
        stream.close()
    assert done.wait(10)
    assert got == list(range(1, 63))  # queued, 60 logs, cancelled


def test_stream_ends_after_the_terminal_event(server, store, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    stream = RawStream(server.url, key, job_id)
    assert stream.next_event()["id"] == "1"
    seq = finish(store, job_id)
    append(store, job_id)  # written after the end: not part of this stream
    event = stream.next_event()
    assert int(event["id"]) == seq and event["data"]["data"]["state"] == "cancelled"
    assert stream.next() == ("eof", None)
    stream.close()
    # Resuming after the end gets an empty stream that closes at once.
    t0 = time.monotonic()
    stream = RawStream(server.url, key, job_id, last_event_id=str(seq + 1))
    assert stream.next_event() is None and time.monotonic() - t0 < 2
    stream.close()


def test_stream_refuses_a_bad_last_event_id_and_other_tenants(server, keys) -> None:
    key = keys.new()
    job_id = submit(server.url, key)
    stream = RawStream(server.url, key, job_id, last_event_id="abc")
    assert stream.response.status == 400
    stream.close()
    stream = RawStream(server.url, keys.new("other", "read"), job_id)
    assert stream.response.status == 404
    stream.close()


def test_follow_yields_every_event_and_stops_at_the_end(server, store, keys) -> None:
    key = keys.new()
    client = SchedulerClient(server.url, key)
    job_id = client.submit("train", CONFIG)["id"]
    append(store, job_id, 3)
    threading.Timer(0.5, lambda: finish(store, job_id)).start()
    events = list(client.follow(job_id))
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
    assert events[-1]["type"] == "state" and events[-1]["data"]["state"] == "cancelled"
    assert [e["seq"] for e in client.follow(job_id, after=2)] == [3, 4, 5]
    assert list(client.follow(job_id, after=5)) == []  # resumed past the end: nothing, and it returns
    with pytest.raises(SchedulerError) as refused:
        list(SchedulerClient(server.url, keys.new("other", "read")).follow(job_id))
    assert refused.value.status == 404


def test_follow_reconnects_after_the_connection_drops(server, store, keys) -> None:
    key = keys.new()
    proxy = DropProxy(server.port)
    client = SchedulerClient(proxy.url, key, backoff=0.05)
    job_id = client.submit("train", CONFIG)["id"]
    got: list[int] = []
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            for event in client.follow(job_id):
                got.append(event["seq"])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    drops = 0
    for round_ in range(4):
        deadline = time.monotonic() + 5
        while len(got) < 1 + 5 * round_:  # wait until this round's events arrived
            assert time.monotonic() < deadline and not failure, (got, failure)
            time.sleep(0.01)
        drops += proxy.drop()
        append(store, job_id, 5)  # written while the client is cut off or reconnecting
    finish(store, job_id)
    reader.join(timeout=10)
    proxy.close()
    assert not reader.is_alive() and not failure, failure
    assert drops >= 4
    assert got == list(range(1, 23))  # queued, 20 logs, cancelled: nothing lost, nothing twice


def test_a_submission_whose_answer_is_lost_is_retried_into_one_job(server, store, keys) -> None:
    key = keys.new()
    proxy = DropProxy(server.port)
    client = SchedulerClient(proxy.url, key, backoff=0.05)
    proxy.lose_answers = 2  # the first two attempts reach the scheduler and create; their answers never arrive
    job = client.submit("train", CONFIG, name="once")
    proxy.close()
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 1
        assert conn.execute(select(jobs.c.id)).scalar_one() == job["id"]


def test_a_first_attempt_cut_off_by_a_restart_does_not_hold_its_key(server, store, keys) -> None:
    key = keys.new()
    body = {"kind": "train", "config": CONFIG, "gpus": 1, "priority": 0, "name": "", "max_attempts": None}
    with store.transaction() as conn:  # what a scheduler process killed between claiming the key and its work leaves
        conn.execute(insert(idempotency).values(tenant_id="acme", method="POST", path="/v1/jobs", key="orphan",
                                                body_digest=fingerprint(body), status=None, response=IN_FLIGHT + "0123456789abcdef",
                                                created_at=time.time()))
    client = SchedulerClient(server.url, key, backoff=0.05, in_flight_wait=0.0)
    job = client.submit("train", CONFIG, idempotency_key="orphan")  # taken over at once, not after STALE_AFTER_S
    assert job["state"] == "queued" and client.submit("train", CONFIG, idempotency_key="orphan")["id"] == job["id"]


def test_a_post_waits_while_its_first_attempt_is_in_flight(server, store, keys) -> None:
    key = keys.new()
    client = SchedulerClient(server.url, key, backoff=0.05)
    body = {"kind": "train", "config": CONFIG, "gpus": 1, "priority": 0, "name": "", "max_attempts": None}
    where = (idempotency.c.key == "stuck",)
    with store.transaction() as conn:  # as a first attempt that is still running would have left it
        conn.execute(insert(idempotency).values(tenant_id="acme", method="POST", path="/v1/jobs", key="stuck",
                                                body_digest=fingerprint(body), status=None, response=IN_FLIGHT + server.app.state.store.owner,
                                                created_at=time.time()))

    def first_attempt_ends() -> None:
        time.sleep(0.6)
        with store.transaction() as conn:
            conn.execute(delete(idempotency).where(*where))

    threading.Thread(target=first_attempt_ends).start()
    t0 = time.monotonic()
    job = client.submit("train", CONFIG, idempotency_key="stuck")
    assert 0.5 < time.monotonic() - t0 < 5 and job["state"] == "queued"
    impatient = SchedulerClient(server.url, key, backoff=0.05, in_flight_wait=0.3)
    with store.transaction() as conn:
        conn.execute(update(idempotency).where(*where).values(status=None, response=IN_FLIGHT + server.app.state.store.owner))
    with pytest.raises(SchedulerError) as refused:
        impatient.submit("train", CONFIG, idempotency_key="stuck")
    assert refused.value.status == 409 and "in flight" in str(refused.value)


def test_open_streams_are_counted_in_the_metrics(server, store, keys) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    scraper = keys.new("ops", "metrics")

    def open_streams() -> float:
        request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {scraper}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "tinkergym_scheduler_event_streams_open"]
        return family.samples[0].value

    key = keys.new()
    job_id = submit(server.url, key)
    assert open_streams() == 0
    stream = RawStream(server.url, key, job_id)
    assert stream.next_event()["event"] == "state"
    assert open_streams() == 1
    stream.close()
    deadline = time.monotonic() + 10
    while open_streams() != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_streams() == 0
