"""Jobs that cannot run say so: each queued job's reason (API, CLI, the client's progress line, the event stream),
``--refuse-unplaceable``, and ``serve model --scheduler --detach`` returning at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

import workerkit as kit  # registered by conftest.py
from click.testing import CliRunner
from sqlalchemy import update

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main
from tinkergym.client import SchedulerClient, wait_running
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import make_engine, tenants

REPO = Path(__file__).resolve().parents[2]


def reason(client: Any, key: str, job_id: str) -> dict[str, str]:
    response = client.get(f"/v1/jobs/{job_id}", headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return response.json()["wait_reason"]


def listed_reasons(client: Any, key: str) -> dict[str, Any]:
    response = client.get("/v1/jobs", headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return {j["id"]: (j["wait_reason"] or {}).get("code") for j in response.json()["jobs"]}


def set_max_gpus(db_url: str, tenant: str, n: int) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(tenants).where(tenants.c.id == tenant).values(max_gpus=n))
    finally:
        engine.dispose()


def events_of(client: Any, key: str, job_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/events", headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return response.json()["events"]


def test_each_reason_appears_when_it_should(make_client: Any, keys: Any, db_url: str) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock, lease_ttl_s=10.0)
    user = keys.new("acme", "read,write")
    job = kit.submit(client, user, gpus=1, model="tiny")
    assert reason(client, user, job)["code"] == "no_worker"

    elsewhere = kit.register(client, keys.worker(8, tenants=("globex",)), name="pool", devices=2)
    assert elsewhere.id and reason(client, user, job)["code"] == "no_worker", "a worker serving other tenants only does not count"

    w = kit.register(client, keys.worker(8), name="w1", devices=2, models=("tiny",))
    wrong_model = kit.submit(client, user, model="smollm2-136m")
    too_big = kit.multi_device_job(client.app, gpus=3)  # stored past the API, which would accept it: train jobs shard
    missing = reason(client, user, wrong_model)
    assert missing["code"] == "no_model" and "smollm2-136m" in missing["message"] and "tiny" in missing["message"]
    large = reason(client, user, too_big)
    assert large["code"] == "too_few_devices" and "3 slots" in large["message"] and "the largest has 2 slots" in large["message"]
    assert reason(client, user, job)["code"] == "ready"

    assert w.lease()["job_id"] == job  # holds 1 of 2 devices
    pair = kit.multi_device_job(client.app, gpus=2)
    busy = reason(client, user, pair)
    assert busy["code"] == "busy" and "the 1 worker that can host it has its devices held" in busy["message"]
    clock.advance(1.0)  # the queue's order is priority, then age
    behind = kit.multi_device_job(client.app, gpus=2)
    behind_reason = reason(client, user, behind)
    assert behind_reason["code"] == "behind" and "behind 1 queued job" in behind_reason["message"]
    listed = listed_reasons(client, user)
    assert listed[job] is None and listed[pair] == "busy" and listed[behind] == "behind" and listed[wrong_model] == "no_model"

    set_max_gpus(db_url, "acme", 2)
    quota = reason(client, user, pair)
    assert quota["code"] == "quota" and "1 of its 2" in quota["message"]

    clock.advance(1000.0)  # every worker is gone now
    assert reason(client, user, pair)["code"] == "no_worker"
    w.lease()  # w1 calls again: alive
    assert reason(client, user, wrong_model)["code"] == "no_model"


def test_a_waiting_event_once_per_change_of_reason(make_client: Any, keys: Any) -> None:
    from tinkergym.scheduler import placement

    client = make_client()
    app = client.app
    user = keys.new("acme", "read,write")
    job = kit.submit(client, user, model="tiny")
    assert placement.note_wait_reasons(app) == 1
    assert placement.note_wait_reasons(app) == 0, "the same reason again is no new event"
    waiting = [e for e in events_of(client, user, job) if e["type"] == "waiting"]
    assert [e["data"]["code"] for e in waiting] == ["no_worker"]

    kit.register(client, keys.worker(8), devices=1, models=("other",))
    placement.note_wait_reasons(app)
    kit.register(client, keys.worker(8), name="w2", devices=1, models=("tiny",))
    placement.note_wait_reasons(app)
    placement.note_wait_reasons(app)
    waiting = [e for e in events_of(client, user, job) if e["type"] == "waiting"]
    assert [e["data"]["code"] for e in waiting] == ["no_worker", "no_model", "ready"]


def test_the_sweeper_streams_the_waiting_event(db_url: str, keys: Any, tmp_path: Path) -> None:
    user = keys.new("acme", "read,write")
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sweep_interval_s=0.05)))
    client = SchedulerClient(server.url, user)
    try:
        job = client.submit("train", {"model": "smollm2-136m"})["id"]
        give_up = threading.Timer(60.0, lambda: SchedulerClient(server.url, user).cancel(job))  # ends the stream if no event comes
        give_up.start()
        try:
            waiting = next((e for e in client.follow(job) if e["type"] == "waiting"), None)
        finally:
            give_up.cancel()
        assert waiting is not None, "the stream carries a waiting event"
        assert waiting["data"]["code"] == "no_worker" and "smollm2-136m" in waiting["data"]["message"]
        client.cancel(job)
        assert [e["type"] for e in client.events(job)].count("waiting") == 1
    finally:
        client.close()
        server.stop()


def test_refuse_unplaceable_refuses_what_no_worker_offered(make_client: Any, keys: Any) -> None:
    from tinkergym.scheduler import placement

    clock = kit.Clock()
    client = make_client(refuse_unplaceable=True, clock=clock)
    user = keys.new("acme", "read,write")

    def post(model: str, gpus: int = 1) -> Any:
        return client.post("/v1/jobs", json={"kind": "train", "config": {"model": model}, "gpus": gpus}, headers=kit.auth(user))

    def unplaceable(gpus: int) -> str | None:  # placement's answer for a multi-device job
        with client.app.state.store.read() as conn:
            return placement.refusal(conn, "acme", "tiny", gpus)

    refused = post("tiny")
    assert refused.status_code == 400 and "no worker has registered" in refused.json()["error"]["message"]
    kit.register(client, keys.worker(8), devices=2, models=("tiny",))
    assert post("tiny").status_code == 201 and unplaceable(2) is None
    wrong = post("smollm2-136m")
    assert wrong.status_code == 400
    assert "no worker offers model smollm2-136m" in wrong.json()["error"]["message"] and "tiny: up to 2" in wrong.json()["error"]["message"]
    assert "has 3 devices" in (unplaceable(3) or "")
    big = post("tiny", gpus=3)
    assert big.status_code == 400 and "no worker offering tiny has 3 devices" in big.json()["error"]["message"]  # train jobs shard: no worker has 3
    clock.advance(10_000.0)  # the worker is gone, but it offered tiny: a job for it may wait for its return
    assert post("tiny").status_code == 201


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[ThreadServer]:
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data")))
    try:
        yield server
    finally:
        server.stop()


def test_serve_model_detach_exits_at_once_and_jobs_show_says_why(server: ThreadServer, keys: Any) -> None:
    user = keys.new("acme", "read,write")
    env = {**os.environ, "TINKERGYM_API_KEY": user, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tinkergym", "serve", "model", "--scheduler", server.url, "--model", "smollm2-136m", "--detach"],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout.splitlines()[-1])["job"]
    assert f"tinkergym jobs show {job}" in done.stderr

    shown = CliRunner().invoke(main, ["jobs", "show", job, "--scheduler", server.url, "--api-key", user], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "reason:" in shown.output and "no_worker" in shown.output and "tinkergym worker --models smollm2-136m" in shown.output
    listed = CliRunner().invoke(main, ["jobs", "list", "--scheduler", server.url, "--api-key", user], catch_exceptions=False)
    header, row = listed.output.splitlines()[:2]
    assert "REASON" in header.split() and "no_worker" in row.split()


class Hinted(Exception):
    pass


def test_the_progress_line_says_why_and_an_unplaceable_job_says_how_to_go_on(server: ThreadServer, keys: Any) -> None:
    user = keys.new("acme", "read,write")
    client = SchedulerClient(server.url, user)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if "keeps waiting" in line:
            raise Hinted

    try:
        job = kit.multi_device_job(server.app, gpus=3, model="smollm2-136m")  # stored past the API
        with pytest.raises(Hinted):
            wait_running(client, job, poll=0.01, say=say, unplaceable_after=0.0, timeout=60.0)
        assert "no worker is alive" in lines[0]
        assert f"tinkergym jobs cancel {job}" in lines[-1] and "tinkergym worker --models smollm2-136m" in lines[-1]
        assert sum("keeps waiting" in line for line in lines) == 1
    finally:
        client.close()


def test_a_view_of_a_job_past_the_sweepers_pass_reads_the_pass_not_the_queue(make_client: Any, keys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue longer than the sweeper's pass reads: a view of a job the pass did not reach says it is behind the pass's
    front, from the pass, without reading the queue again (at 10,000 queued jobs that read made every view cost 500 jobs'
    order); a job submitted after the pass is placed by a read of its own."""
    from tinkergym.scheduler import leases, placement

    client = make_client(cache_s=1.0, clock=kit.Clock())
    user = keys.new("acme", "read,write")
    kit.register(client, keys.worker(8), devices=1)
    jobs = []
    for _ in range(4):
        jobs.append(kit.submit(client, user))
        client.app.state.store.clock.advance(1.0)  # the queue's order is their age
    monkeypatch.setattr(leases, "MAX_SCAN", 2)
    placement.note_wait_reasons(client.app)
    read = []
    order = placement.grant_order
    monkeypatch.setattr(placement, "grant_order", lambda *a, **k: read.append(1) or order(*a, **k))
    past = reason(client, user, jobs[3])
    assert past["code"] == "behind" and "behind at least 2 queued jobs" in past["message"] and not read
    assert reason(client, user, jobs[0])["code"] == "ready" and not read  # within the pass: its reason as found
    client.app.state.store.clock.advance(1.0)
    late = kit.submit(client, user)
    assert reason(client, user, late)["code"] in ("behind", "busy") and read == [1], "a job newer than the pass is read now"


def test_a_reservation_ends_with_its_job_past_the_passs_reach(make_client: Any, keys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A starving job's reservation (the worker draining for it) ends when the job is no longer queued, also when the queue
    is longer than the sweeper's pass reads: it held its worker's drain for a job that was gone."""
    from tinkergym.scheduler import leases, placement

    client = make_client(clock=kit.Clock())
    user = keys.new("acme", "read,write")
    kit.register(client, keys.worker(8), devices=1)
    jobs = [kit.submit(client, user) for _ in range(4)]
    monkeypatch.setattr(leases, "MAX_SCAN", 2)
    client.app.state.reservations.update({jobs[3]: "w-1", jobs[2]: "w-2"})
    assert client.post(f"/v1/jobs/{jobs[3]}/cancel", headers=kit.auth(user)).json()["state"] == "cancelled"
    placement.note_wait_reasons(client.app)
    assert client.app.state.wait_pass["cut"] == 2, "the pass did not reach the reserved jobs"
    assert set(client.app.state.reservations) == {jobs[2]}, "the cancelled job's reservation ended; the queued one's stays"


def test_views_at_the_same_time_share_one_read_of_the_grant_order(make_client: Any, keys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no sweeper's pass to read, the views that ask within ``cache_s`` share one read of the front of the grant order
    (one view reads it, those asking meanwhile wait for it): at 20 views a second each reading it was half the
    scheduler's work. The reasons are those a read of its own finds."""
    from tinkergym.scheduler import placement

    client = make_client(cache_s=30.0, clock=kit.Clock())
    user, other = keys.new("acme", "read,write"), keys.new("globex", "read,write")
    kit.register(client, keys.worker(8), devices=1)
    jobs = []
    for key in (user, other, user, other):
        jobs.append(kit.submit(client, key, gpus=1))
        client.app.state.store.clock.advance(1.0)
    read: list[int] = []
    order = placement.grant_order

    def counted(*a: Any, **k: Any) -> Any:
        read.append(1)
        return order(*a, **k)

    monkeypatch.setattr(placement, "grant_order", counted)
    got: dict[str, Any] = {}
    views = [threading.Thread(target=lambda j=j, k=k: got.__setitem__(j, reason(client, k, j))) for j, k in zip(jobs, (user, other, user, other))]
    for view in views:
        view.start()
    for view in views:
        view.join(30)
    assert len(got) == 4 and read == [1], f"{len(read)} reads of the grant order for 4 views at once"
    assert got[jobs[0]]["code"] == "ready" and {got[j]["code"] for j in jobs[1:]} == {"behind"}
    assert listed_reasons(client, user) == {jobs[0]: "ready", jobs[2]: "behind"} and read == [1], "a list page reads it no more"
    client.app.state.front_cache = None  # as cache_s later
    assert reason(client, other, jobs[1])["code"] == "behind" and read == [1, 1]


def test_the_pass_writes_its_waiting_events_in_short_transactions(make_client: Any, keys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that finds many new reasons writes them a few jobs a transaction: one transaction for all of them held every
    one of those jobs' rows while it wrote, and their heartbeats and state reports waited."""
    from tinkergym.scheduler import placement

    client = make_client()
    user = keys.new("acme", "read,write")
    jobs = [kit.submit(client, user) for _ in range(5)]
    store = client.app.state.store
    opened = []
    transaction = store.transaction
    monkeypatch.setattr(store, "transaction", lambda *a, **k: opened.append(1) or transaction(*a, **k))
    monkeypatch.setattr(placement, "NOTE_BATCH", 2)
    assert placement.note_wait_reasons(client.app) == 5
    assert len(opened) == 3, "5 jobs' events, 2 a transaction"
    assert all([e["type"] for e in events_of(client, user, j)].count("waiting") == 1 for j in jobs)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite's writers take turns: no row is held by another
def test_the_pass_neither_waits_for_nor_loses_a_job_another_transaction_holds(make_client: Any, keys: Any, db_url: str) -> None:
    """A queued job whose row another transaction holds (a grant, a cancel) is passed over by the pass, which waits for
    nobody: waiting there, it held the rows it had locked, in its own order, and a worker's heartbeats, which lock their
    jobs in id order, deadlocked with it. The next pass notes the job it passed over."""
    from sqlalchemy import text

    from tinkergym.scheduler import placement

    client = make_client()
    user = keys.new("acme", "read,write")
    jobs = [kit.submit(client, user) for _ in range(3)]
    holder = make_engine(db_url)
    try:
        with holder.connect() as conn, conn.begin():
            conn.execute(text("SELECT id FROM jobs WHERE id = :j FOR NO KEY UPDATE"), {"j": jobs[1]})
            done: list[int] = []
            passing = threading.Thread(target=lambda: done.append(placement.note_wait_reasons(client.app)))
            passing.start()
            passing.join(20)
            assert done == [2], "the pass noted the two jobs nobody held, without waiting for the third"
        assert [[e["type"] for e in events_of(client, user, j)].count("waiting") for j in jobs] == [1, 0, 1]
        assert placement.note_wait_reasons(client.app) == 1, "the next pass notes the job it passed over, and it alone"
        assert [[e["type"] for e in events_of(client, user, j)].count("waiting") for j in jobs] == [1, 1, 1]
    finally:
        holder.dispose()
