"""One lease request fills many free places (``{"max": n}``): the jobs it takes are the ones n requests one after another
would take, in that order and on those devices; each lease is all-or-none and fenced as a single one is; the answer is
kept for its idempotency key; quotas and the age bound hold within one request."""

from __future__ import annotations

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py

from tinkergym.scheduler import granting, leases


@pytest.fixture
def clock() -> Any:
    return kit.Clock()


def _queue(client: Any, clock: Any, user: str, other: str) -> list[str]:
    """Two tenants' jobs of mixed sizes and priorities, of distinct ages."""
    made = []
    for key, gpus, priority in ((user, 1, 0), (user, 2, 5), (other, 1, 0), (user, 1, 9), (other, 3, 0), (other, 1, 1),
                                (user, 1, 0), (other, 1, 0), (user, 4, 0), (other, 1, 0)):
        if gpus > 1:
            made.append(kit.multi_device_job(client.app, gpus, tenant="acme" if key == user else "globex", priority=priority))
        else:
            made.append(kit.submit(client, key, gpus=gpus, priority=priority))
        clock.advance(1.0)
    return made


def _granted(leased: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    return [(lease["job_id"], lease["devices"]) for lease in leased]


def test_one_request_takes_what_requests_one_after_another_would(make_client: Any, keys: Any, clock: Any) -> None:
    client = make_client(clock=clock, backfill_age_s=600.0)
    user, other = keys.new("acme", "read,write"), keys.new("globex", "read,write")
    worker = kit.register(client, keys.new("ops", "worker"), devices=8)
    _queue(client, clock, user, other)
    app = client.app
    store, settings, secret = app.state.store, app.state.settings, leases.app_secret(app)
    with store.engine.connect() as conn:
        with conn.begin() as trans:
            many = granting.grant_many(conn, store, settings, worker.id, secret, limit=8)
            trans.rollback()
        with conn.begin() as trans:
            singles = [granting.grant(conn, store, settings, worker.id, secret) for _ in range(8)]
            trans.rollback()
    one_by_one = [lease for lease in singles if lease is not None]
    assert len(many) >= 4, "the queue holds jobs for most of 8 devices"
    assert _granted(many) == _granted(one_by_one)
    devices = [d for lease in many for d in lease["devices"]]
    assert len(devices) == len(set(devices)) and len(devices) <= 8, "each lease on places of its own"
    assert len({lease["job_id"] for lease in many}) == len(many)


def test_the_route_answers_every_lease_with_its_token_and_keeps_it_for_its_key(make_client: Any, keys: Any, clock: Any, db_url: str) -> None:
    client = make_client(clock=clock)
    user = keys.new("acme", "read,write")
    worker = kit.register(client, keys.new("ops", "worker"), devices=3)
    jobs = []
    for _ in range(5):
        jobs.append(kit.submit(client, user))
        clock.advance(1.0)
    answer = worker.post("/lease", {"max": 4}, headers={"Idempotency-Key": "fill-1"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [lease["job_id"] for lease in body["leases"]] == jobs[:3], "three free devices: three leases, oldest first"
    assert body["lease"] == body["leases"][0]
    assert sorted(d for lease in body["leases"] for d in lease["devices"]) == [0, 1, 2]
    for lease in body["leases"]:
        assert lease["token"] == leases.token_for(client.app, lease["job_id"], lease["epoch"])
        assert kit.job_row(db_url, lease["job_id"])["state"] == "leased"
    again = worker.post("/lease", {"max": 4}, headers={"Idempotency-Key": "fill-1"})
    assert again.json() == body and again.headers.get("Idempotent-Replayed") == "true"
    reused = worker.post("/lease", {"max": 2}, headers={"Idempotency-Key": "fill-1"})
    assert reused.status_code == 422, "the same key for another request is refused"
    assert worker.post("/lease", {"max": 4}).json() == {"lease": None, "leases": []}, "no device free"
    kit.assert_no_double_grant(db_url)
    for bad in (0, -1, granting.MAX_GRANTS + 1, "many"):
        refused = worker.post("/lease", {"max": bad})
        assert refused.status_code == 400 and "max" in refused.text, (bad, refused.text)
    # a worker of today's agent asks with no body, or an empty one: one lease, as ever
    second = kit.register(client, worker.key, name="w2", devices=2)
    plain = second.post("/lease")
    assert plain.status_code == 200 and len(plain.json()["leases"]) == 1 and plain.json()["lease"]["job_id"] == jobs[3]


def test_quota_and_the_age_bound_hold_within_one_request(make_client: Any, keys: Any, clock: Any, db_url: str) -> None:
    client = make_client(clock=clock, backfill_age_s=60.0)
    user = keys.new("acme", "read,write")
    store = client.app.state.store
    from sqlalchemy import update

    from tinkergym.scheduler.db import tenants

    with store.transaction() as conn:
        conn.execute(update(tenants).where(tenants.c.id == "acme").values(max_gpus=2))
    worker = kit.register(client, keys.new("ops", "worker"), devices=4)
    for _ in range(4):
        kit.submit(client, user)
        clock.advance(1.0)
    got = worker.post("/lease", {"max": 4}).json()["leases"]
    assert len(got) == 2, "the tenant's quota of 2 devices holds inside one request"
    kit.assert_no_double_grant(db_url)

    # a 3-device job past the age bound: the worker's last 2 free devices drain to it; nothing behind it starts around it
    other = keys.new("globex", "read,write")
    big = kit.multi_device_job(client.app, 3, tenant="globex")
    clock.advance(1.0)
    small = [kit.submit(client, other) for _ in range(3)]
    clock.advance(120.0)
    got = worker.post("/lease", {"max": 4}).json()["leases"]
    assert got == [], "two free devices drain for the starving 3-device job"
    assert kit.job_row(db_url, big)["state"] == "queued" and all(kit.job_row(db_url, j)["state"] == "queued" for j in small)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite's grants share the one writer: the same store
def test_a_lease_request_never_waits_for_the_pool_the_other_routes_share(make_client: Any, keys: Any, db_url: str) -> None:
    """Lease requests run on a connection of their own (grants go one at a time): with every connection of the pool that
    state reports, heartbeats and views share held (a burst of them at 1,000 workers), a lease is granted all the same."""
    client = make_client()
    user = keys.new("acme", "read,write")
    worker = kit.register(client, keys.new("ops", "worker"), devices=1)
    job = kit.submit(client, user)
    engine = client.app.state.engine
    engine.pool._timeout = 3.0  # a request waiting for the shared pool fails in 3 s, not SQLAlchemy's 30
    held = [engine.connect() for _ in range(15)]  # SQLAlchemy's pool: 5 connections and 10 more past them
    try:
        assert engine.pool.checkedout() == 15
        lease = worker.lease()
        assert lease is not None and lease["job_id"] == job
    finally:
        for conn in held:
            conn.close()
    assert kit.job_row(db_url, job)["state"] == "leased"
