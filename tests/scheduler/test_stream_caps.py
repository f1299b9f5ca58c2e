"""Event streams bounded against many clients: caps per key and overall (429 with Retry-After), slots freed on close,
one watcher query per interval however many streams are idle, a revoked key's streams ended; against a live server."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from testkit import wait_until  # registered by tests/conftest.py

from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.auth import revoke_key
from tinkergym.scheduler.db import make_engine
from tinkergym.scheduler.repository import JobStore

from tinkergym.serve.asgi import ThreadServer
from tinkergym.client import SchedulerClient

CONFIG = {"model": "smollm2-135m", "env": "tinker/Bandit-v0"}
#: A failure bound only (a stream that never answers fails the test instead of hanging it).
GIVE_UP_S = 20.0


@pytest.fixture
def start(db_url: str, tmp_path: Path) -> Iterator[Any]:
    servers: list[ThreadServer] = []

    def run(**settings: Any) -> ThreadServer:
        settings = {"sse_keepalive_s": 3600.0, **settings}
        live = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", **settings), background=False))
        servers.append(live)
        return live

    yield run
    for live in servers:
        live.stop()


@pytest.fixture
def store(db_url: str) -> Iterator[JobStore]:
    engine = make_engine(db_url)
    yield JobStore(engine)
    engine.dispose()


class Stream:
    """One event stream on its own connection: the status, headers and body of the answer, and its events."""

    def __init__(self, live: ThreadServer, key: str, job_id: str) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=GIVE_UP_S)
        self.connection.request("GET", f"/v1/jobs/{job_id}/events/stream", headers={"Authorization": f"Bearer {key}"})
        self.response = self.connection.getresponse()
        self.status = self.response.status
        self.body = json.loads(self.response.read()) if self.status != 200 else None

    def next_event(self) -> dict[str, Any] | None:
        """The next event's JSON, or None when the stream ended (cleanly: a broken one raises)."""
        fields: dict[str, str] = {}
        while True:
            line = self.response.readline()
            if not line:
                return None
            text = line.decode().rstrip("\n")
            if not text:
                if "data" in fields:
                    return json.loads(fields["data"])
                fields = {}
            elif not text.startswith(":"):
                name, _, value = text.partition(": ")
                fields[name] = value

    def close(self) -> None:
        self.connection.close()


def submit(live: ThreadServer, key: str) -> str:
    return SchedulerClient(live.url, key).submit("train", CONFIG)["id"]


def log(store: JobStore, job_id: str) -> int:
    with store.transaction() as conn:
        return store.append_event(conn, job_id, "log", {"line": "hello"})


def test_streams_past_a_keys_cap_or_the_apps_are_refused_429_and_a_closed_one_frees_its_slot(start, keys) -> None:
    live = start(max_streams_per_key=2, max_streams=3)
    key_a, key_b, key_c = keys.new("acme"), keys.new("acme"), keys.new("other")
    job, other_job = submit(live, key_a), submit(live, key_c)
    first, second = Stream(live, key_a, job), Stream(live, key_a, job)
    assert (first.status, second.status) == (200, 200)
    refused = Stream(live, key_a, job)
    assert refused.status == 429 and refused.body["error"]["type"] == "too_many_streams"
    assert refused.response.getheader("Retry-After", "").isdigit()
    message = refused.body["error"]["message"]
    assert "2 event streams open" in message and "--max-streams-per-key" in message
    another_key = Stream(live, key_b, job)  # the same tenant's other key still gets its stream: the third of the app
    assert another_key.status == 200 and another_key.next_event()["seq"] == 1
    overall = Stream(live, key_c, other_job)
    assert overall.status == 429 and overall.response.getheader("Retry-After", "").isdigit()
    assert "3 event streams open" in overall.body["error"]["message"] and "--max-streams N" in overall.body["error"]["message"]
    first.close()  # the server notices the client left and frees the slot
    wait_until("the closed stream's slot", lambda: live.app.state.streams.per_key.get(key_a.split("_")[1]) == 1, GIVE_UP_S, 0.01)
    again = Stream(live, key_a, job)
    assert again.status == 200 and again.next_event()["seq"] == 1
    for stream in (second, another_key, again):
        stream.close()
    wait_until("every slot freed", lambda: not live.app.state.streams.subscriptions, GIVE_UP_S, 0.01)
    assert Stream(live, key_c, other_job).status == 200


def test_a_stream_refused_404_holds_no_slot(start, keys) -> None:
    live = start(max_streams_per_key=1)
    key = keys.new("acme")
    missing = Stream(live, key, "job_that_does_not_exist")
    assert missing.status == 404
    job = submit(live, key)
    stream = Stream(live, key, job)  # the 404 held no slot
    assert stream.status == 200
    stream.close()


def test_idle_streams_cost_one_query_per_watcher_pass_not_one_per_stream(start, keys, store) -> None:
    live = start(max_streams_per_key=32, sse_poll_s=0.05)
    key = keys.new("acme")
    jobs = [submit(live, key) for _ in range(4)]
    streams = [Stream(live, key, jobs[i % 4]) for i in range(20)]
    assert all(s.next_event()["seq"] == 1 for s in streams)  # every stream sent its backlog and is idle
    hub = live.app.state.streams
    # A pass that ran while a stream was still sending its backlog woke it for one more (empty) read: let those pass.
    settled = hub.passes + 3
    wait_until("three watcher passes", lambda: hub.passes >= settled, GIVE_UP_S, 0.01)
    statements: list[str] = []
    listener = lambda conn, cursor, statement, *args: statements.append(statement)  # noqa: E731
    event.listen(live.app.state.engine, "before_cursor_execute", listener)
    try:
        passes, counted = hub.passes, len(statements)
        wait_until("ten watcher passes", lambda: hub.passes >= passes + 10, GIVE_UP_S, 0.01)
        passes, counted = hub.passes - passes, len(statements) - counted
    finally:
        event.remove(live.app.state.engine, "before_cursor_execute", listener)
    # One statement per pass (a pass may straddle either end of the count); 20 polling streams would make 20 per pass.
    assert passes - 1 <= counted <= passes + 1, (passes, counted, statements[-3:])
    # A new event still reaches the streams of its job, and only those.
    seq = log(store, jobs[0])
    for i, stream in enumerate(streams):
        if i % 4 == 0:
            assert stream.next_event()["seq"] == seq
    for stream in streams:
        stream.close()


def test_the_watcher_survives_database_errors(start, keys, store, monkeypatch: pytest.MonkeyPatch) -> None:
    live = start(sse_poll_s=0.05)
    key = keys.new("acme")
    job = submit(live, key)
    stream = Stream(live, key, job)
    assert stream.next_event()["seq"] == 1
    hub = live.app.state.streams
    read, failing = hub._read, threading.Event()
    failing.set()

    def flaky(*args: Any) -> Any:
        if failing.is_set():
            raise OperationalError("SELECT", {}, Exception("the database went away"))
        return read(*args)

    monkeypatch.setattr(hub, "_read", flaky)
    wait_until("three failed passes", lambda: hub.failures >= 3, GIVE_UP_S, 0.01)
    seq = log(store, job)  # written while the watcher cannot read
    failing.clear()
    assert stream.next_event()["seq"] == seq
    stream.close()


def test_a_revoked_keys_streams_end_and_others_go_on(start, keys, store, db_url: str) -> None:
    live = start(sse_poll_s=0.05)
    revoked, kept = keys.new("acme"), keys.new("acme")
    job = submit(live, kept)
    doomed = [Stream(live, revoked, job) for _ in range(3)]
    survivor = Stream(live, kept, job)
    assert all(s.next_event()["seq"] == 1 for s in [*doomed, survivor])
    engine = make_engine(db_url)
    try:
        assert revoke_key(engine, revoked.split("_")[1])
    finally:
        engine.dispose()
    assert all(s.next_event() is None for s in doomed)  # ended cleanly (a broken chunked stream would raise)
    wait_until("the revoked key's slots freed", lambda: revoked.split("_")[1] not in live.app.state.streams.per_key, GIVE_UP_S, 0.01)
    seq = log(store, job)
    assert survivor.next_event()["seq"] == seq
    assert Stream(live, revoked, job).status == 401
    for stream in (*doomed, survivor):
        stream.close()
