"""Leases: all-or-none grants, order (priority, age, backfill with an age bound), quotas, expiry, the sweeper, tokens."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py

from tinkergym.scheduler import granting, leases
from tinkergym.scheduler.repository import Conflict

Clock, register, submit, job_row, allocated, query = kit.Clock, kit.register, kit.submit, kit.job_row, kit.allocated, kit.query


@pytest.fixture
def clock() -> Any:
    return Clock()


@pytest.fixture
def setup(make_client: Any, keys: Any, clock: Any) -> Any:
    """A client with a fake clock, a user key (tenant acme) and a worker key (tenant ops)."""

    class Setup:
        client = make_client(clock=clock, lease_ttl_s=30.0, backfill_age_s=600.0)
        user = keys.new("acme", "read,write")
        worker = keys.new("ops", "worker")

        def job(self, gpus: int = 1, priority: int = 0, model: str = "tiny", key: str | None = None, **extra: Any) -> str:
            """A queued job: submitted through the API, or on more than one device stored past it (the API refuses those today)."""
            if gpus > 1:
                assert key is None, "multi-device jobs here are acme's"
                job_id = kit.multi_device_job(self.client.app, gpus, priority=priority, model=model, **extra)
            else:
                job_id = submit(self.client, key or self.user, gpus=gpus, priority=priority, model=model, **extra)
            clock.advance(1.0)  # distinct ages
            return job_id

    return Setup()


# ----- granting ---------------------------------------------------------------------------------------
def test_lease_gives_job_devices_token_and_event(setup: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=2)
    job_id = setup.job(gpus=2)
    lease = w.lease()
    assert lease["job_id"] == job_id and lease["kind"] == "train" and lease["config"] == {"model": "tiny"}
    assert lease["epoch"] == 1 and lease["devices"] == [0, 1] and lease["checkpoint"] is None
    assert lease["expires_at"] == pytest.approx(setup.client.app.state.settings.clock() + 30.0)
    row = job_row(db_url, job_id)
    assert row["state"] == "leased" and row["lease_epoch"] == 1 and row["worker_id"] == w.id
    assert len(allocated(db_url, job_id)) == 2
    events = setup.client.get(f"/v1/jobs/{job_id}/events", headers=kit.auth(setup.user)).json()["events"]
    assert [e["type"] for e in events][-2:] == ["state", "lease"] and events[-1]["data"]["epoch"] == 1
    assert w.lease() is None  # nothing else queued, no device free


def test_a_lease_is_written_in_three_statements_whatever_its_devices(setup: Any, clock: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant writes the job's row (with its cursor moved past both events), its two events and its devices' rows: one
    statement each, for 1 device or 4 (the general transition took five and one a device). A job leased before also
    reads its last checkpoint."""
    from sqlalchemy import event

    engine = setup.client.app.state.grant_store.engine if getattr(setup.client.app.state, "grant_store", None) else setup.client.app.state.store.engine
    taken: list[list[str]] = []
    take = granting._take

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen: list[str] = []

        def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            seen.append(statement.split()[0].upper())

        event.listen(engine, "after_cursor_execute", count)
        try:
            return take(*args, **kwargs)
        finally:
            event.remove(engine, "after_cursor_execute", count)
            taken.append(seen)

    monkeypatch.setattr(granting, "_take", counted)
    w = register(setup.client, setup.worker, devices=5)
    one, four = setup.job(gpus=1), setup.job(gpus=4, max_attempts=2)
    assert w.lease()["job_id"] == one and w.lease()["job_id"] == four
    assert taken == [["UPDATE", "INSERT", "INSERT"]] * 2, taken
    events = setup.client.get(f"/v1/jobs/{four}/events", headers=kit.auth(setup.user)).json()["events"]
    assert [e["type"] for e in events][-2:] == ["state", "lease"] and [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-2]["data"] == {"state": "leased", "attempt": 0, "epoch": 1}
    assert events[-1]["data"] == {"epoch": 1, "devices": 4, "expires_at": pytest.approx(setup.client.app.state.settings.clock() + 30.0), "attempt": 0}
    assert len(allocated(db_url, four)) == 4
    for state in ("starting", "running", "succeeded"):
        assert w.state(four, 1, state, server_url="http://127.0.0.1:9").status_code == 200
    clock.advance(31.0)
    assert leases.sweep(setup.client.app) == 1  # the other lost: queued again
    assert w.lease()["job_id"] == one
    assert taken[-1] == ["UPDATE", "INSERT", "INSERT", "SELECT"], taken  # leased before: its last checkpoint is read


def test_a_transition_is_written_in_two_statements(setup: Any, db_url: str) -> None:
    """A state change writes the job's row with its event number (``UPDATE ... RETURNING``) and its event: two statements
    (it took four: the update, a read of the row, the cursor's update and the event). A refused change writes nothing."""
    from sqlalchemy import event

    store = setup.client.app.state.store
    w = register(setup.client, setup.worker, devices=1)
    job = setup.job()
    lease = w.lease()
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        seen.append(statement.split()[0].upper())

    event.listen(store.engine, "after_cursor_execute", count)
    try:
        with store.transaction() as conn:
            moved = store.transition(conn, job, "starting", epoch=lease["epoch"], event={"worker": w.id})
    finally:
        event.remove(store.engine, "after_cursor_execute", count)
    assert [s for s in seen if s in ("UPDATE", "INSERT", "SELECT")] == ["UPDATE", "INSERT"], seen
    assert moved.job["state"] == "starting" and moved.job["cursor"] == moved.event_seq == 4  # queued, leased, lease, starting
    events = setup.client.get(f"/v1/jobs/{job}/events", headers=kit.auth(setup.user)).json()["events"]
    assert events[-1]["seq"] == 4 and events[-1]["data"] == {"state": "starting", "attempt": 0, "worker": w.id}
    with pytest.raises(Conflict, match=f"job {job} is starting: it cannot become leased"), store.transaction() as conn:
        store.transition(conn, job, "leased")
    with pytest.raises(Conflict, match="at lease epoch 7"), store.transaction() as conn:
        store.transition(conn, job, "running", epoch=7)
    assert kit.query(db_url, "SELECT cursor FROM jobs WHERE id = :j", j=job)[0][0] == 4, "a refused change moves no cursor"


def test_job_gets_all_its_devices_or_none(setup: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=2)
    setup.job(gpus=1)
    first = w.lease()
    big = setup.job(gpus=2)
    assert first is not None and w.lease() is None  # one device free, the 2-device job needs two
    assert job_row(db_url, big)["state"] == "queued" and allocated(db_url, big) == []
    kit.assert_no_double_grant(db_url)


def test_job_needs_a_worker_serving_its_model(setup: Any) -> None:
    w = register(setup.client, setup.worker, devices=1, models=("other",))
    setup.job(model="tiny")
    assert w.lease() is None


def test_two_schedulers_racing_for_one_job_exactly_one_wins(make_client: Any, keys: Any, db_url: str) -> None:
    user, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    first = make_client()
    second = make_client()  # a second app (a second scheduler process) on the same database
    workers = [register(first, worker_key, name=f"w{i}", devices=1) for i in range(4)]
    workers = [kit.Worker(second if i % 2 else first, w.key, w.id) for i, w in enumerate(workers)]
    job_id = submit(first, user, gpus=1)
    barrier = threading.Barrier(len(workers))
    got: list[Any] = [None] * len(workers)

    def take(i: int) -> None:
        barrier.wait()
        got[i] = workers[i].lease()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [g for g in got if g is not None]
    assert len(winners) == 1 and winners[0]["job_id"] == job_id and winners[0]["epoch"] == 1
    assert len(allocated(db_url, job_id)) == 1
    kit.assert_no_double_grant(db_url)


def test_concurrent_lease_requests_never_grant_a_device_twice(setup: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=3)
    jobs = [setup.job(gpus=g) for g in (2, 1, 2, 1, 1)]
    barrier = threading.Barrier(6)
    got: list[Any] = []

    def take() -> None:
        barrier.wait()
        lease = w.lease()
        if lease is not None:
            got.append(lease)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    devices = [d for lease in got for d in lease["devices"]]
    assert len(devices) == len(set(devices)) and len(devices) <= 3
    assert {lease["job_id"] for lease in got} <= set(jobs)
    kit.assert_no_double_grant(db_url)


def test_priority_then_age(setup: Any) -> None:
    w = register(setup.client, setup.worker, devices=1)
    old_low = setup.job(priority=0)
    new_high = setup.job(priority=5)
    order = []
    for _ in range(2):
        lease = w.lease()
        order.append(lease["job_id"])
        assert w.state(lease["job_id"], lease["epoch"], "starting").status_code == 200
        assert w.state(lease["job_id"], lease["epoch"], "running", server_url="http://127.0.0.1:9000").status_code == 200
        assert w.state(lease["job_id"], lease["epoch"], "succeeded").status_code == 200
    assert order == [new_high, old_low]
    # Same priority: the older first.
    a, b = setup.job(), setup.job()
    assert w.lease()["job_id"] == a and b != a


def test_backfill_small_job_starts_around_a_big_one_until_the_age_bound(setup: Any, clock: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=2)
    setup.job(gpus=1)
    holder = w.lease()  # one of two devices busy
    big = setup.job(gpus=2, priority=1)  # the head of the queue: cannot start (one device free)
    small = setup.job(gpus=1)
    backfilled = w.lease()
    assert backfilled is not None and backfilled["job_id"] == small  # backfill: the small job does not wait
    assert job_row(db_url, big)["state"] == "queued"
    # Free the backfilled device; past the age bound, the next small job no longer jumps ahead of the big one.
    assert w.state(small, backfilled["epoch"], "cancelled").status_code == 409  # only a cancelling job is cancelled
    assert w.state(small, backfilled["epoch"], "failed", error="boom").status_code == 200
    clock.advance(601.0)
    late_small = setup.job(gpus=1)
    assert w.lease() is None  # the big job has waited > backfill_age_s: its devices drain to it
    assert job_row(db_url, late_small)["state"] == "queued"
    # A worker that could never host the big job (one device) still backfills.
    other = register(setup.client, setup.worker, name="w-small", devices=1)
    assert other.lease()["job_id"] == late_small
    # Once the holder ends, the big job gets both devices.
    assert w.state(holder["job_id"], holder["epoch"], "failed").status_code == 200
    lease = w.lease()
    assert lease["job_id"] == big and lease["devices"] == [0, 1]
    kit.assert_no_double_grant(db_url)


def test_tenant_quota_waits_without_blocking_others(setup: Any, keys: Any, db_url: str) -> None:
    from sqlalchemy import update

    from tinkergym.scheduler.db import make_engine, tenants

    other_user = keys.new("globex", "read,write")
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(tenants).where(tenants.c.id == "acme").values(max_gpus=2))
    engine.dispose()
    w = register(setup.client, setup.worker, devices=4)
    a1 = setup.job(gpus=2)
    a2 = setup.job(gpus=1)  # acme would hold 3 > 2
    g1 = setup.job(gpus=1, key=other_user)
    assert w.lease()["job_id"] == a1
    assert w.lease()["job_id"] == g1  # a2 is over quota: skipped, it does not block globex
    assert w.lease() is None
    assert job_row(db_url, a2)["state"] == "queued"
    assert w.state(a1, 1, "failed").status_code == 200  # acme's devices freed: a2 may start
    assert w.lease()["job_id"] == a2


# ----- expiry -----------------------------------------------------------------------------------------
def test_expiry_requeues_with_attempt_plus_one_and_frees_devices(setup: Any, clock: Any, db_url: str) -> None:
    app = setup.client.app
    w = register(setup.client, setup.worker, devices=2)
    job_id = setup.job(gpus=2, max_attempts=2)
    lease = w.lease()
    for state in ("starting", "running"):  # lost mid-run, after running a whole lease (a lease lost before counts against the worker)
        assert w.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    for _ in range(2):
        clock.advance(20.0)
        assert w.heartbeat(job_id, lease["epoch"]).status_code == 200
    clock.advance(29.0)
    assert leases.sweep(app) == 0  # not yet
    clock.advance(2.0)
    assert leases.sweep(app) == 1
    row = job_row(db_url, job_id)
    assert row["state"] == "queued" and row["attempt"] == 1 and row["worker_id"] is None and row["lease_expires_at"] is None
    assert row["server_token_digest"] is None and allocated(db_url) == []
    # The old holder is fenced out everywhere.
    assert w.heartbeat(job_id, lease["epoch"]).status_code == 409
    assert w.state(job_id, lease["epoch"], "starting").status_code == 409
    # Granted again at a new epoch; the second loss reaches max_attempts (2): failed.
    again = w.lease()
    assert again["job_id"] == job_id and again["epoch"] == 2 and again["attempt"] == 1
    for state in ("starting", "running"):
        assert w.state(job_id, again["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    assert leases.LossPolicy.of(app.state.settings).quarantine_losses > 2  # this worker's two losses do not quarantine it
    for _ in range(2):
        clock.advance(20.0)
        assert w.heartbeat(job_id, again["epoch"]).status_code == 200
    clock.advance(31.0)
    assert leases.sweep(app) == 1
    row = job_row(db_url, job_id)
    assert row["state"] == "failed" and row["attempt"] == 2 and "lost" in row["error"] and allocated(db_url) == []
    assert w.lease() is None


def test_cancelling_job_whose_lease_expires_is_cancelled(setup: Any, clock: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=1)
    job_id = setup.job()
    lease = w.lease()
    assert setup.client.post(f"/v1/jobs/{job_id}/cancel", headers=kit.auth(setup.user)).json()["state"] == "cancelling"
    beat = w.heartbeat(job_id, lease["epoch"])
    assert beat.status_code == 200 and beat.json()["cancelling"] is True
    clock.advance(31.0)
    assert leases.sweep(setup.client.app) == 1
    assert job_row(db_url, job_id)["state"] == "cancelled" and allocated(db_url) == []


def test_heartbeat_renews_so_sweep_keeps_the_lease(setup: Any, clock: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=1)
    job_id = setup.job()
    lease = w.lease()
    for _ in range(4):
        clock.advance(20.0)
        beat = w.heartbeat(job_id, lease["epoch"])
        assert beat.status_code == 200 and beat.json()["expires_at"] == pytest.approx(clock() + 30.0)
        assert leases.sweep(setup.client.app) == 0
    assert job_row(db_url, job_id)["state"] == "leased"
    clock.advance(31.0)  # no heartbeat: past its end, the heartbeat itself is refused, before any sweep
    assert w.heartbeat(job_id, lease["epoch"]).status_code == 409
    assert leases.sweep(setup.client.app) == 1


def test_expire_compares_epoch_and_expiry(setup: Any, clock: Any, db_url: str) -> None:
    w = register(setup.client, setup.worker, devices=1)
    job_id = setup.job()
    lease = w.lease()
    store = setup.client.app.state.store
    assert not leases.expire(store, job_id, lease["epoch"], clock() + 10.0)  # not ended by then
    assert not leases.expire(store, job_id, lease["epoch"] + 1, clock() + 60.0)  # another epoch
    assert leases.expire(store, job_id, lease["epoch"], clock() + 60.0)
    assert not leases.expire(store, job_id, lease["epoch"], clock() + 60.0)  # once
    assert job_row(db_url, job_id)["attempt"] == 0  # lost before it ran on its worker: the worker's strike, not the job's attempt


def test_background_sweeper_expires_a_lease_with_no_other_traffic(make_client: Any, keys: Any, db_url: str) -> None:
    client = make_client(background=True, lease_ttl_s=0.5, sweep_interval_s=0.1)
    user, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    w = register(client, worker_key, devices=1)
    job_id = submit(client, user)
    assert w.lease()["job_id"] == job_id
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # read the database directly: no request that could do the work
        row = job_row(db_url, job_id)
        if row["state"] == "queued":
            break
        time.sleep(0.05)
    assert row["state"] == "queued" and row["attempt"] == 0 and allocated(db_url) == []  # never ran: no attempt counted


def test_sweeper_survives_errors_and_wakes_early(make_client: Any, monkeypatch: Any) -> None:
    calls: list[float] = []
    real = leases.sweep

    def flaky(app: Any) -> int:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("database away")
        return real(app)

    monkeypatch.setattr(leases, "sweep", flaky)
    client = make_client(background=True, sweep_interval_s=0.2)
    deadline = time.monotonic() + 5.0
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(calls) >= 3  # the error did not end the task
    monkeypatch.setattr(client.app.state.settings, "sweep_interval_s", 30.0)
    time.sleep(0.5)  # the task is now in a 30 s wait
    before = len(calls)
    threading.Thread(target=leases.wake, args=(client.app,)).start()  # from another thread, as a sync route does
    deadline = time.monotonic() + 5.0
    while len(calls) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(calls) > before


# ----- the server token -------------------------------------------------------------------------------
def test_server_token_is_a_stable_hmac_and_only_its_digest_is_stored(setup: Any, db_url: str, tmp_path: Path) -> None:
    import hashlib
    import hmac

    w = register(setup.client, setup.worker, devices=1)
    job_id = setup.job()
    lease = w.lease()
    secret_file = Path(setup.client.app.state.settings.data_dir) / "scheduler.secret"
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    secret = secret_file.read_bytes()
    assert len(secret) == 32
    expected = leases.server_token(secret, job_id, lease["epoch"])
    assert lease["token"] == expected == leases.token_for(setup.client.app, job_id, lease["epoch"])
    mac = hmac.new(secret, f"{job_id}:{lease['epoch']}".encode(), hashlib.sha256).digest()
    import base64

    assert expected == "tgs_" + base64.urlsafe_b64encode(mac).decode().rstrip("=")
    assert leases.server_token(secret, job_id, lease["epoch"] + 1) != expected  # a new epoch, a new token
    row = job_row(db_url, job_id)
    assert row["server_token_digest"] == hashlib.sha256(expected.encode()).hexdigest() == leases.token_digest(expected)
    dump = repr(query(db_url, "SELECT * FROM jobs")) + repr(query(db_url, "SELECT * FROM events")) + repr(query(db_url, "SELECT * FROM idempotency"))
    assert expected not in dump and expected[4:] not in dump
    # The secret survives a restart (same file), and a fresh folder gets a new one with mode 0600.
    assert leases.load_secret(secret_file.parent) == secret
    fresh = leases.load_secret(tmp_path / "fresh")
    assert len(fresh) == 32 and fresh != secret
    assert stat.S_IMODE(os.stat(tmp_path / "fresh" / "scheduler.secret").st_mode) == 0o600


def test_secret_created_once_under_concurrency(tmp_path: Path) -> None:
    got: list[bytes] = []
    barrier = threading.Barrier(8)

    def load() -> None:
        barrier.wait()
        got.append(leases.load_secret(tmp_path))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scheduler.secret"]
