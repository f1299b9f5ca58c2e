"""One heartbeat call for all of a worker's leases (``POST /v1/workers/{id}/heartbeats``) does what a heartbeat per lease
does: the same expiry, device-seconds, tokens, cancel deadline and strikes; a lease it no longer holds is answered lost
while the others are renewed."""

from __future__ import annotations

import json

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py
from sqlalchemy import update

from tinkergym.scheduler import leases
from tinkergym.scheduler.db import workers

COLS = "state, lease_expires_at, device_seconds, tokens_trained, tokens_sampled, usage_reported"


def _cluster(make_client: Any, keys: Any, clock: kit.Clock) -> tuple[Any, Any, str, list[str]]:
    client = make_client(clock=clock, lease_ttl_s=30.0, cancel_deadline_s=45.0)
    user = keys.new("acme", "read,write")
    worker = kit.register(client, keys.new("ops", "worker"), devices=3)
    jobs = [kit.submit(client, user) for _ in range(3)]
    for _ in jobs:
        assert worker.lease() is not None
    return client, worker, user, jobs


def _rows(db_url: str, jobs: list[str]) -> list[tuple[Any, ...]]:
    return [kit.query(db_url, f"SELECT {COLS} FROM jobs WHERE id = :j", j=j)[0] for j in jobs]


def test_one_call_renews_every_lease_as_one_heartbeat_each_does(make_client: Any, keys: Any, tmp_path: Any) -> None:
    """Two clusters driven alike, one heartbeat per lease in one and one call for all in the other: the same rows."""
    seen = []
    for batched in (False, True):
        clock = kit.Clock()
        client, worker, user, jobs = _cluster(make_client, keys, clock)
        epochs = {j: kit.job_row(client.app.state.settings.db_url, j)["lease_epoch"] for j in jobs}
        for j in jobs:
            assert worker.state(j, epochs[j], "starting").status_code == 200
            assert worker.state(j, epochs[j], "running", server_url="http://127.0.0.1:9/").status_code == 200
        assert client.post(f"/v1/jobs/{jobs[2]}/cancel", headers=kit.auth(user)).json()["state"] == "cancelling"
        for step in range(3):
            clock.advance(10.0)
            # the second lease's server reports no usage: a renewal without a report beside ones with it
            usage = {j: {"tokens_trained": 100 * (step + 1), "tokens_sampled": 7 * (step + 1)} if j != jobs[1] else None for j in jobs}
            if batched:
                answer = worker.post("/heartbeats", {"leases": [{"job_id": j, "epoch": epochs[j], "usage": usage[j]} for j in jobs]})
                assert answer.status_code == 200, answer.text
                beats = answer.json()["leases"]
            else:
                beats = []
                for j in jobs:
                    response = worker.post(f"/jobs/{j}/heartbeat", {"epoch": epochs[j], "usage": usage[j]})
                    assert response.status_code == 200, response.text
                    beats.append(response.json())
            assert [b["cancelling"] for b in beats] == [False, False, True]
            assert [b["expires_at"] for b in beats] == pytest.approx([clock() + 30.0, clock() + 30.0, min(clock() + 30.0, 1_000_000.0 + 45.0)])
        seen.append(_rows(client.app.state.settings.db_url, jobs))
    assert seen[0] == seen[1]
    assert seen[1][0][2] == pytest.approx(30.0)  # 3 renewals of 10 s on one device
    assert seen[1][0][3:5] == (300, 21)
    assert seen[1][1][3:6] == (0, 0, None), "no usage reported: none charged, none kept"


def test_a_calls_leases_are_renewed_in_one_statement(make_client: Any, keys: Any, db_url: str) -> None:
    """PostgreSQL renews all of a call's leases in one ``UPDATE`` (their rows as typed arrays, unnested), not one a lease:
    at 1,000 workers the renewals were PostgreSQL's most frequent statement. SQLite, in-process, runs one a lease."""
    clock = kit.Clock()
    client, worker, _, jobs = _cluster(make_client, keys, clock)
    epochs = {j: kit.job_row(db_url, j)["lease_epoch"] for j in jobs}
    from sqlalchemy import event

    renewals: list[tuple[str, bool]] = []

    def count(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE JOBS"):
            renewals.append((statement, executemany))

    clock.advance(5.0)
    event.listen(client.app.state.store.engine, "after_cursor_execute", count)
    try:
        usage = {"tokens_trained": 5, "tokens_sampled": 0}
        answer = worker.post("/heartbeats", {"leases": [{"job_id": j, "epoch": epochs[j], "usage": usage if j == jobs[0] else None} for j in jobs]})
    finally:
        event.remove(client.app.state.store.engine, "after_cursor_execute", count)
    assert answer.status_code == 200, answer.text
    assert [b["expires_at"] for b in answer.json()["leases"]] == pytest.approx([clock() + 30.0] * 3)
    assert len(renewals) == 1
    if db_url.startswith("postgresql"):
        assert "unnest" in renewals[0][0] and not renewals[0][1], "one statement, not one a lease"
    else:
        assert renewals[0][1], "SQLite: one statement a lease"
    assert [row[1] for row in _rows(db_url, jobs)] == pytest.approx([clock() + 30.0] * 3)
    assert [row[3] for row in _rows(db_url, jobs)] == [5, 0, 0]


def test_a_lost_lease_is_answered_lost_and_the_others_are_renewed(make_client: Any, keys: Any) -> None:
    clock = kit.Clock()
    client, worker, user, jobs = _cluster(make_client, keys, clock)
    db_url = client.app.state.settings.db_url
    epochs = {j: kit.job_row(db_url, j)["lease_epoch"] for j in jobs}
    other = kit.register(client, keys.new("ops2", "worker"), name="w2", devices=1)
    beats = [{"job_id": jobs[0], "epoch": epochs[jobs[0]]}, {"job_id": jobs[1], "epoch": epochs[jobs[1]] + 1},
             {"job_id": "j-none", "epoch": 1}, {"job_id": jobs[0], "epoch": epochs[jobs[0]]}]
    answer = worker.post("/heartbeats", {"leases": beats}).json()["leases"]
    assert [a["lost"] for a in answer] == [False, True, True, True]
    assert "stale" in answer[1]["error"] and "no job" in answer[2]["error"] and "twice" in answer[3]["error"]
    assert kit.job_row(db_url, jobs[0])["lease_expires_at"] == pytest.approx(clock() + 30.0)
    # another worker naming these leases renews none of them
    assert other.post("/heartbeats", {"leases": [{"job_id": jobs[2], "epoch": epochs[jobs[2]]}]}).json()["leases"][0]["lost"] is True
    # past its end a lease is lost before any sweep, and the sweep then queues its job again
    clock.advance(31.0)
    late = worker.post("/heartbeats", {"leases": [{"job_id": j, "epoch": epochs[j]} for j in jobs]}).json()["leases"]
    assert all(a["lost"] for a in late)
    assert leases.sweep(client.app) == 3


def test_heartbeats_are_the_workers_own_and_bounded(make_client: Any, keys: Any) -> None:
    clock = kit.Clock()
    client, worker, user, jobs = _cluster(make_client, keys, clock)
    body = {"leases": [{"job_id": jobs[0], "epoch": 1}]}
    assert client.post(f"/v1/workers/{worker.id}/heartbeats", json=body, headers=kit.auth(user)).status_code == 403  # a tenant's key
    stranger = keys.new("ops3", "worker")
    assert client.post(f"/v1/workers/{worker.id}/heartbeats", json=body, headers=kit.auth(stranger)).status_code == 404
    too_many = {"leases": [{"job_id": jobs[0], "epoch": 1}] * (leases.MAX_BEATS + 1)}
    assert worker.post("/heartbeats", too_many).status_code in (400, 422)
    assert worker.post("/heartbeats", {"leases": []}).json() == {"leases": []}
    # odd job ids and epochs are leases it does not hold, answered lost, never a 500
    for job_id, epoch in (("job\x00x", 1), ("\ud800", 1), ("../" + jobs[0], 1), (jobs[0], 2**62)):
        answer = client.post(f"/v1/workers/{worker.id}/heartbeats", content=json.dumps({"leases": [{"job_id": job_id, "epoch": epoch}]}),
                             headers={**kit.auth(worker.key), "Content-Type": "application/json"})
        assert answer.status_code in (200, 400, 422), (job_id, answer.status_code, answer.text)
        if answer.status_code == 200:
            assert answer.json()["leases"][0]["lost"] is True
    # a worker that heartbeats proves it runs its jobs: its strikes end at its first heartbeat after "running"
    db_url = client.app.state.settings.db_url
    with client.app.state.store.transaction() as conn:
        conn.execute(update(workers).where(workers.c.id == worker.id).values(strikes=1))
    assert worker.state(jobs[0], 1, "starting").status_code == 200
    assert worker.state(jobs[0], 1, "running", server_url="http://127.0.0.1:9/").status_code == 200
    clock.advance(5.0)
    assert worker.post("/heartbeats", body).status_code == 200
    assert kit.query(db_url, "SELECT strikes FROM workers WHERE id = :w", w=worker.id) == [(0,)]


def test_a_call_the_database_rolled_back_for_a_deadlock_runs_again(make_client: Any, keys: Any, db_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL breaks a deadlock by rolling one transaction back (SQLSTATE 40P01): the worker's heartbeats run again,
    whole, rather than answering 500 (its leases would then go unrenewed for an interval)."""
    clock = kit.Clock()
    client, worker, _, jobs = _cluster(make_client, keys, clock)
    clock.advance(10.0)
    flaky, runs = kit.deadlocked_once(leases.heartbeat_many, "SELECT jobs ... FOR NO KEY UPDATE")
    monkeypatch.setattr(leases, "heartbeat_many", flaky)
    epochs = {j: kit.job_row(db_url, j)["lease_epoch"] for j in jobs}
    answer = worker.post("/heartbeats", {"leases": [{"job_id": j, "epoch": epochs[j]} for j in jobs]})
    assert answer.status_code == 200 and len(runs) == 2, (answer.text, runs)
    assert all(kit.job_row(db_url, j)["lease_expires_at"] == pytest.approx(clock() + 30.0) for j in jobs)


def test_only_a_transaction_rolled_back_for_another_runs_again() -> None:
    """A deadlock (40P01) or a serialization failure runs the transaction again; another error of the database (here a
    unique violation, 23505) is raised at once, not run a second time."""
    from sqlalchemy.exc import OperationalError

    from tinkergym.scheduler.routes import RETRYABLE, rerun_rolled_back

    assert "40P01" in RETRYABLE and "23505" not in RETRYABLE
    flaky, runs = kit.deadlocked_once(lambda: "done", "UPDATE jobs ...")
    assert rerun_rolled_back(flaky) == "done" and len(runs) == 2
    flaky, runs = kit.deadlocked_once(lambda: "done", "INSERT INTO jobs ...", sqlstate="23505")
    with pytest.raises(OperationalError):
        rerun_rolled_back(flaky)
    assert len(runs) == 1


def test_a_workers_row_is_written_at_most_once_a_second(make_client: Any, keys: Any, db_url: str) -> None:
    """Each call of a worker says it is alive, but its row is written once a second at most: at 1,000 workers a write at
    every call was a third of PostgreSQL's time, its calls waiting on each other's lock of the row."""
    clock = kit.Clock()
    client, worker, _, jobs = _cluster(make_client, keys, clock)
    epoch = kit.job_row(db_url, jobs[0])["lease_epoch"]

    def seen() -> float:
        return kit.query(db_url, "SELECT last_seen_at FROM workers WHERE id = :w", w=worker.id)[0][0]

    clock.advance(5.0)
    assert worker.heartbeat(jobs[0], epoch).status_code == 200 and seen() == pytest.approx(clock())
    first = clock()
    clock.advance(0.5)
    from sqlalchemy import event

    writes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE WORKERS"):
            writes.append(statement)

    event.listen(client.app.state.store.engine, "after_cursor_execute", count)
    try:
        assert worker.post("/heartbeats", {"leases": [{"job_id": jobs[0], "epoch": epoch}]}).status_code == 200
    finally:
        event.remove(client.app.state.store.engine, "after_cursor_execute", count)
    assert seen() == pytest.approx(first), "seen half a second ago: not written again"
    assert writes == [], "nor asked about: the scheduler wrote it half a second ago"
    clock.advance(0.6)
    assert worker.heartbeat(jobs[0], epoch).status_code == 200 and seen() == pytest.approx(clock())
