"""The grant order: fair share among tenants (held devices over share), then priority and age within a tenant; and a grant's work does not
grow with the queue."""

from __future__ import annotations

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py
from click.testing import CliRunner
from sqlalchemy import event

from tinkergym.cli import main
from tinkergym.scheduler import fairshare, granting, leases

auth = kit.auth


def _tenants(db_url: str, keys: Any, *names: str) -> list[str]:
    return [keys.new(name, "read,write") for name in names]


def _owner(db_url: str, job_id: str) -> str:
    return kit.query(db_url, "SELECT tenant_id FROM jobs WHERE id = :j", j=job_id)[0][0]


def test_tenants_take_turns_whatever_order_they_submitted_in(make_client: Any, keys: Any, db_url: str) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock)
    first, late = _tenants(db_url, keys, "first", "late")
    for key in [first] * 6 + [late] * 6:
        kit.submit(client, key)
        clock.advance(1.0)
    worker = kit.register(client, keys.worker(8), devices=6)
    owners = [_owner(db_url, worker.lease()["job_id"]) for _ in range(6)]
    assert owners == ["first", "late"] * 3, "each free device goes to the tenant holding the least"


def test_a_tenant_gets_the_cluster_in_proportion_to_its_share(make_client: Any, keys: Any, db_url: str) -> None:
    client = make_client(clock=kit.Clock())
    big, small = _tenants(db_url, keys, "big", "small")
    ran = CliRunner().invoke(main, ["scheduler", "tenants", "set", "big", "--share", "3", "--db", db_url])
    assert ran.exit_code == 0 and "share=3" in ran.output, ran.output
    listed = CliRunner().invoke(main, ["scheduler", "tenants", "list", "--db", db_url]).output
    assert "SHARE" in listed.splitlines()[0]
    for _ in range(8):
        kit.submit(client, small)
        kit.submit(client, big)
    worker = kit.register(client, keys.worker(8), devices=8)
    owners = [_owner(db_url, worker.lease()["job_id"]) for _ in range(8)]
    assert owners.count("big") == 6 and owners.count("small") == 2, owners
    # a share must be positive: refused before any write
    refused = CliRunner().invoke(main, ["scheduler", "tenants", "set", "big", "--share", "0", "--db", db_url])
    assert refused.exit_code == 2


def test_priority_orders_a_tenants_own_jobs_only_and_a_tenant_alone_gets_everything(make_client: Any, keys: Any, db_url: str) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock)
    rich, poor = _tenants(db_url, keys, "rich", "poor")

    def submit(key: str, **extra: Any) -> str:
        clock.advance(1.0)
        return kit.submit(client, key, **extra)

    routine = submit(rich)
    urgent = [submit(rich, priority=5) for _ in range(2)]
    low = submit(poor, priority=-5)
    worker = kit.register(client, keys.worker(8), devices=4)
    # rich's urgent jobs go before its older routine one; poor (holding nothing after rich's first grant) gets the next
    # place whatever the priorities: a tenant raising its jobs' priority does not get past another tenant's share
    assert [worker.lease()["job_id"] for _ in range(4)] == [urgent[0], low, urgent[1], routine]
    alone = kit.register(client, keys.worker(8), name="w2", devices=3)
    mine = [submit(rich) for _ in range(3)]
    assert [alone.lease()["job_id"] for _ in range(3)] == mine  # no other tenant has work: rich takes it all, by age


def test_a_starving_job_drains_one_worker_and_the_others_keep_backfilling(make_client: Any, keys: Any, db_url: str) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock, backfill_age_s=60.0)
    (acme,) = _tenants(db_url, keys, "acme")
    one, two = kit.register(client, keys.worker(8), name="w1", devices=2), kit.register(client, keys.worker(8), name="w2", devices=2)
    first = [kit.submit(client, acme) for _ in range(2)]
    assert {one.lease()["job_id"], two.lease()["job_id"]} == set(first)  # one device busy on each worker
    clock.advance(1.0)
    big = kit.multi_device_job(client.app, 2)
    clock.advance(1.0)
    small = [kit.submit(client, acme) for _ in range(3)]
    clock.advance(61.0)  # big has waited past the backfill age
    assert one.lease() is None, "the first worker to meet the starving job drains for it"
    assert two.lease()["job_id"] in small, "the other worker keeps backfilling"
    assert client.app.state.reservations[big] == one.id
    # the draining worker's running job ends: the big job starts there, and its reservation ends
    job = kit.job_row(db_url, first[0])["worker_id"] == one.id and first[0] or first[1]
    epoch = kit.job_row(db_url, job)["lease_epoch"]
    assert one.state(job, epoch, "failed", error="done").status_code == 200
    assert one.lease()["job_id"] == big and big not in client.app.state.reservations


def test_a_draining_worker_reads_its_job_alone_and_others_pass_it_without_a_read(
        make_client: Any, keys: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker draining for a starving job reads no other starving job (it would take none); another worker's request
    passes a job whose holder this scheduler saw alive without asking about the holder; once the holder is gone past the
    worker timeout, the next worker to meet the job drains for it instead."""
    clock = kit.Clock()
    client = make_client(clock=clock, backfill_age_s=60.0)
    (acme,) = _tenants(db_url, keys, "acme")
    one, two, three = (kit.register(client, keys.worker(8), name=f"w{i}", devices=2) for i in (1, 2, 3))
    first = [kit.submit(client, acme) for _ in range(3)]
    assert {one.lease()["job_id"], two.lease()["job_id"], three.lease()["job_id"]} == set(first)  # one device busy on each
    clock.advance(1.0)
    older = kit.multi_device_job(client.app, 2)
    clock.advance(1.0)
    big = kit.multi_device_job(client.app, 2)
    clock.advance(1.0)
    small = [kit.submit(client, acme) for _ in range(3)]
    clock.advance(61.0)
    assert two.lease() is None and one.lease() is None, "each drains for a starving job"
    reservations = client.app.state.reservations
    assert reservations[older] == two.id and reservations[big] == one.id
    looked: list[str] = []
    walk = fairshare.fair_queue

    def recorded(*args: Any, **kwargs: Any) -> Any:
        for job in walk(*args, **kwargs):
            looked.append(job["id"])
            yield job

    monkeypatch.setattr(fairshare, "fair_queue", recorded)
    clock.advance(1.0)
    assert one.lease() is None, "still draining"
    assert looked == [big], "its own job alone: not the older one another worker drains for"
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(" ".join(statement.split()))

    engines = {client.app.state.store.engine, getattr(client.app.state, "grant_store", client.app.state.store).engine}  # grants' own on PostgreSQL
    for engine in engines:
        event.listen(engine, "after_cursor_execute", count)
    try:
        assert three.lease()["job_id"] in small, "a worker draining for nothing keeps backfilling"
    finally:
        for engine in engines:
            event.remove(engine, "after_cursor_execute", count)
    assert any(s.startswith("UPDATE jobs") for s in statements), "the grant's statements were seen"
    assert not [s for s in statements if s.startswith("SELECT workers.last_seen_at")], "the holders were not asked about"
    # the holder goes silent past the worker timeout: the next worker to meet the job drains for it
    settings, store = client.app.state.settings, client.app.state.store
    clock.advance(leases.worker_timeout(settings) + 1.0)
    with store.read() as conn:
        alive_since = clock() - leases.worker_timeout(settings)
        assert granting._drains_for(conn, store, reservations, big, three.id, None, alive_since)
        assert reservations[big] == three.id
        assert not granting._drains_for(conn, store, reservations, older, three.id, big, alive_since), "one job at a time"


def test_held_devices_count_a_seat_as_its_share_of_the_device(make_client: Any, keys: Any, db_url: str) -> None:
    clock = kit.Clock()
    client = make_client(clock=clock)
    (acme,) = _tenants(db_url, keys, "acme")
    body = {"name": "w1", "host": "127.0.0.1", "models": ["tiny"], "devices": [
        {"index": 0, "kind": "slot"}, {"index": 1, "kind": "slot", "shared": {"seats": 4, "model": "tiny", "max_lora_rank": 64}}]}
    key = keys.worker(8)
    worker = kit.Worker(client, key, client.post("/v1/workers", json=body, headers=auth(key)).json()["id"])
    for rank in (8, 0):
        answer = client.post("/v1/jobs", json={"kind": "train", "config": {"model": "tiny", "lora_rank": rank}}, headers=auth(acme))
        assert answer.status_code == 201, answer.text
        clock.advance(1.0)
    assert worker.lease()["seat"] is not None and worker.lease()["seat"] is None
    with client.app.state.store.read() as conn:
        assert fairshare.held_devices(conn) == {"acme": pytest.approx(1.25)}
    usage = fairshare.Usage(ttl_s=3600.0)
    with client.app.state.store.read() as conn:
        assert usage.held(conn) == {"acme": pytest.approx(1.25)}
    usage.granted("acme", 2.0)
    usage.granted("globex", 1.0)
    with client.app.state.store.read() as conn:
        assert usage.held(conn) == {"acme": pytest.approx(3.25), "globex": 1.0}  # counted up between reads


def test_a_grants_statements_do_not_grow_with_the_queue(make_client: Any, keys: Any, db_url: str) -> None:
    """A worker whose one free device fits none of the queued 2-device jobs reads a few jobs of each tenant's queue, however
    long: the statements of its lease request, and the queued rows they read, are the same for 120 queued jobs and for 900
    (each tenant's queue is read :data:`fairshare.DEPTH` deep at most)."""
    clock = kit.Clock()
    client = make_client(clock=clock)
    _tenants(db_url, keys, "a", "b", "c")
    worker = kit.register(client, keys.worker(8), devices=1)
    engine = client.app.state.store.engine

    def one_grant() -> tuple[int, int]:
        clock.advance(5.0)  # each request writes that the worker was seen (a second after the last write at most)
        seen = {"statements": 0, "queued_rows": 0}

        def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            seen["statements"] += 1

        read = fairshare.queue_heads

        def heads(*args: Any, **kwargs: Any) -> Any:
            found = read(*args, **kwargs)
            seen["queued_rows"] += sum(len(q) for q in found.values())
            return found

        event.listen(engine, "after_cursor_execute", count)
        fairshare.queue_heads = heads  # type: ignore[assignment]
        try:
            assert worker.lease() is None
        finally:
            fairshare.queue_heads = read  # type: ignore[assignment]
            event.remove(engine, "after_cursor_execute", count)
        return seen["statements"], seen["queued_rows"]

    for i in range(3 * fairshare.DEPTH + 24):
        kit.multi_device_job(client.app, 2, tenant="abc"[i % 3])
    small = one_grant()
    for i in range(780 - 3 * fairshare.DEPTH):
        kit.multi_device_job(client.app, 2, tenant="abc"[i % 3])
    large = one_grant()
    assert small == large, (small, large)
    assert large[1] == 0  # none of the jobs within DEPTH of each queue fits: the database passed over them all
    # ... and it read DEPTH index entries of each queue at most, however long (the plan's limit on the window)
    if db_url.startswith("postgresql"):
        from sqlalchemy import or_, text

        query = fairshare._tenant_page("a", None, fairshare.PAGE, lambda c: or_(c.gpus <= 1, c.created_at < 0.0))
        compiled = query.compile(engine, compile_kwargs={"literal_binds": True})
        with engine.connect() as conn:
            plan = "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT TEXT) {compiled}")))
        assert "Index Scan" in plan and f"rows={fairshare.DEPTH} " in plan.split("Limit")[2], plan


def test_a_locked_worker_row_does_not_block_a_state_report_of_its_jobs(make_client: Any, keys: Any, db_url: str) -> None:
    """The grant holds its worker's row; another of that worker's jobs meanwhile writes a row that refers to the worker
    (the foreign-key check's KEY SHARE lock). That write must not wait for the grant: FOR UPDATE made it wait, and the two
    deadlocked under load."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no row locks")
    from sqlalchemy import select, text

    from tinkergym.scheduler.db import make_engine, workers
    from tinkergym.scheduler.worker_registry import locked

    client = make_client(clock=kit.Clock())
    (acme,) = _tenants(db_url, keys, "acme")
    worker = kit.register(client, keys.worker(8), devices=2)
    job = kit.submit(client, acme)
    engine = make_engine(db_url)
    try:
        with engine.connect() as grant, engine.connect() as report:
            grant.begin()
            assert grant.execute(locked(grant, select(workers.c.id).where(workers.c.id == worker.id))).first() is not None
            report.begin()
            report.execute(text("SET LOCAL lock_timeout = '2s'"))
            # the state report's writes: the job points at its worker (checked against workers by the foreign key)
            report.execute(text("UPDATE jobs SET worker_id = :w WHERE id = :j"), {"w": worker.id, "j": job})
            report.rollback()
            grant.rollback()
    finally:
        engine.dispose()


def test_a_request_whose_transaction_the_database_broke_for_a_deadlock_runs_again(make_client: Any, keys: Any) -> None:
    """PostgreSQL breaks a deadlock by rolling one transaction back (SQLSTATE 40P01): that request runs again, whole,
    rather than answering 500; any other database error is not retried."""
    from tinkergym.scheduler import idempotency

    client = make_client()
    user = keys.new("acme", "read,write")
    job = kit.submit(client, user)
    worker = kit.register(client, keys.worker(8), devices=1)
    original = idempotency.run_once
    flaky, runs = kit.deadlocked_once(original, "UPDATE jobs ...")
    idempotency.run_once = flaky  # type: ignore[assignment]
    try:
        lease = worker.lease()
    finally:
        idempotency.run_once = original  # type: ignore[assignment]
    assert lease is not None and lease["job_id"] == job and len(runs) == 2, runs
