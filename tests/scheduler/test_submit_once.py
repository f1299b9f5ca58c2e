"""Submissions in one transaction: the Idempotency-Key looked up, the job created and the key stored together, under
concurrency, across two scheduler processes on one database, with quotas counted atomically; the auth middleware's
key lookups from the event loop; PostgreSQL connections pinged only when idle."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sqlalchemy import func, insert, select, text
from tinkergym.serve.asgi import ThreadServer
from tinkergym.scheduler import auth as auth_module
from tinkergym.scheduler import db as db_module
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.auth import KeyLookup, ensure_tenant, revoke_key
from tinkergym.scheduler.db import idempotency, jobs, make_engine, upgrade
from tinkergym.scheduler.idempotency import IdempotencyError, Refused, fingerprint, run_once
from tinkergym.scheduler.repository import JobStore

CONFIG = {"model": "smollm2-135m", "env": "tinker/Bandit-v0", "steps": 3}


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def post_all(ports: list[int], key: str, bodies: list[bytes], idempotency_keys: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """POST /v1/jobs once per body, all at once (a barrier), spread over the servers on ``ports``."""
    barrier = threading.Barrier(len(bodies))

    def post(i: int) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", ports[i % len(ports)], timeout=60)
        try:
            conn.connect()
            barrier.wait()
            headers = auth(key, **{"Idempotency-Key": idempotency_keys[i], "Content-Type": "application/json"})
            conn.request("POST", "/v1/jobs", body=bodies[i], headers=headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, range(len(bodies))))


def counts(db_url: str) -> tuple[int, int]:
    """(jobs, idempotency keys) in the database."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return (conn.execute(select(func.count()).select_from(jobs)).scalar_one(),
                    conn.execute(select(func.count()).select_from(idempotency)).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.slow
def test_one_key_sent_to_two_scheduler_processes_at_once_makes_one_job(db_url, keys, tmp_path: Path) -> None:
    """Two apps (two stores, as two processes would have) on one database: the key is claimed once, whichever wins."""
    key = keys.new()
    servers = [ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / f"data{i}"), background=False)) for i in range(2)]
    body = json.dumps({"kind": "train", "config": CONFIG, "name": "once"}).encode()
    idem = str(uuid.uuid4())
    try:
        answers = post_all([s.port for s in servers], key, [body] * 40, [idem] * 40)
        again = post_all([s.port for s in servers], key, [body] * 4, [idem] * 4)  # after: every one a replay
    finally:
        for server in servers:
            server.stop()
    assert {status for status, _ in answers} <= {201, 409}, answers
    created = {payload["id"] for status, payload in answers if status == 201}
    assert len(created) == 1, created
    assert [status for status, _ in again] == [201] * 4 and {p["id"] for _, p in again} == created
    assert counts(db_url) == (1, 1)


def test_the_queue_quota_holds_under_concurrent_submissions(db_url, keys, tmp_path: Path) -> None:
    """30 submissions at once (distinct keys) for a tenant with room for 5: exactly 5 are queued, the rest are 429
    and store nothing under their keys."""
    key = keys.new("small")
    engine = make_engine(db_url)
    with engine.begin() as conn:
        ensure_tenant(conn, "small", max_queued=5)
    engine.dispose()
    servers = [ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / f"data{i}"), background=False)) for i in range(2)]
    body = json.dumps({"kind": "train", "config": CONFIG}).encode()
    try:
        answers = post_all([s.port for s in servers], key, [body] * 30, [str(uuid.uuid4()) for _ in range(30)])
    finally:
        for server in servers:
            server.stop()
    statuses = sorted(status for status, _ in answers)
    assert statuses == [201] * 5 + [429] * 25, statuses
    assert all(p["error"]["type"] == "quota" for status, p in answers if status == 429)
    assert counts(db_url) == (5, 5)


@pytest.fixture
def store(db_url: str) -> Any:
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.begin() as conn:
        ensure_tenant(conn, "acme")
    yield JobStore(engine)
    engine.dispose()


def submit_once(store: JobStore, key: str, handler: Any, body: Any = None) -> Any:
    return run_once(store, tenant_id="acme", method="POST", path="/v1/jobs", key=key, body=body or {"n": 1}, handler=handler)


def new_job(store: JobStore) -> Any:
    def handler(conn: Any) -> tuple[int, dict[str, Any]]:
        job = store.create_job(conn, tenant_id="acme", kind="train", gpus=1, config=CONFIG)
        return 201, {"id": job["id"]}

    return handler


def test_a_failed_or_refused_first_request_leaves_no_key_behind(store: JobStore) -> None:
    def fails(conn: Any) -> tuple[int, dict[str, Any]]:
        new_job(store)(conn)  # the job is created, then the request fails: both roll back
        raise RuntimeError("boom")

    def refused(conn: Any) -> tuple[int, dict[str, Any]]:
        new_job(store)(conn)
        raise Refused(429, "quota", "full")

    with pytest.raises(RuntimeError):
        submit_once(store, "k", fails)
    assert submit_once(store, "k", refused).status == 429
    first = submit_once(store, "k", new_job(store))
    assert first.status == 201 and not first.replayed
    again = submit_once(store, "k", new_job(store))
    assert again.replayed and again.body == first.body
    with pytest.raises(IdempotencyError) as other_body:
        submit_once(store, "k", new_job(store), body={"n": 2})
    assert other_body.value.status == 422
    with store.read() as conn:
        assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 1
        assert conn.execute(select(func.count()).select_from(idempotency)).scalar_one() == 1


def test_a_retry_while_the_first_request_runs_is_409(store: JobStore, db_url: str) -> None:
    """In this process (the store's keys in flight) and, on PostgreSQL, in another (the key's advisory lock)."""
    inside, release = threading.Event(), threading.Event()

    def slow(conn: Any) -> tuple[int, dict[str, Any]]:
        inside.set()
        assert release.wait(30)
        return new_job(store)(conn)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(submit_once, store, "k", slow)
        assert inside.wait(30)
        try:
            with pytest.raises(IdempotencyError) as in_flight:
                submit_once(store, "k", new_job(store))
            assert in_flight.value.status == 409
            if store.engine.dialect.name == "postgresql":  # SQLite: another process's transaction waits for the write lock
                other = JobStore(make_engine(db_url))
                try:
                    with pytest.raises(IdempotencyError) as elsewhere:
                        submit_once(other, "k", new_job(other))
                    assert elsewhere.value.status == 409
                finally:
                    other.engine.dispose()
        finally:
            release.set()
        assert first.result().status == 201
    assert submit_once(store, "k", new_job(store)).replayed


def test_a_key_stored_by_another_process_meanwhile_rolls_this_work_back(store: JobStore, db_url: str) -> None:
    """PostgreSQL: a first request of an older scheduler (no advisory lock) commits the key between this request's
    lookup and its insert: this job rolls back and the answer is the one stored."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("on SQLite the write lock, held from the lookup on, lets no other writer in")
    other = make_engine(db_url)

    def racing(conn: Any) -> tuple[int, dict[str, Any]]:
        answer = new_job(store)(conn)
        with other.begin() as elsewhere:
            elsewhere.execute(insert(idempotency).values(tenant_id="acme", method="POST", path="/v1/jobs", key="k",
                                                         body_digest=fingerprint({"n": 1}), status=201, response='{"id": "theirs"}',
                                                         created_at=0.0))
        return answer

    try:
        stored = submit_once(store, "k", racing)
    finally:
        other.dispose()
    assert stored.replayed and stored.body == {"id": "theirs"}
    with store.read() as conn:
        assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 0


# ----- the auth middleware's lookups -------------------------------------------------------------------
def test_key_lookups_from_the_event_loop_see_a_revocation_at_once_and_survive_a_lost_connection(db_url, keys) -> None:
    key = keys.new()
    engine = make_engine(db_url)
    lookup = KeyLookup(engine)

    async def scenario() -> None:
        assert (await lookup.principal(key)).tenant_id == "acme"
        assert await lookup.principal("tgk_0123456789ab_" + "A" * 43) is None
        assert await lookup.principal(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
        # The lookup's connection breaks: this lookup goes to a worker thread, the next opens a new connection.
        await lookup.aclose()
        if engine.dialect.name == "postgresql":
            assert (await lookup.principal(key)) is not None and lookup._connection is not None
            with engine.connect() as conn:  # the server drops the lookup's connection
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": lookup._connection.info.backend_pid})
                conn.commit()
        assert (await lookup.principal(key)).tenant_id == "acme"
        assert revoke_key(engine, key.split("_")[1])
        assert await lookup.principal(key) is None  # no cache: the next request after a revocation is refused
        await lookup.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


def test_a_key_lookup_that_cannot_answer_at_once_goes_to_a_worker_thread(db_url, keys, monkeypatch) -> None:
    key = keys.new()
    engine = make_engine(db_url)
    lookup = KeyLookup(engine)
    calls = []

    def busy(*args: Any) -> Any:
        raise OSError("database is locked")

    def in_thread(*args: Any) -> Any:
        calls.append(threading.get_ident())
        return real(*args)

    real = auth_module.authenticate
    monkeypatch.setattr(lookup, "_sqlite_rows", busy)
    monkeypatch.setattr(lookup, "_postgres_rows", busy)
    monkeypatch.setattr(auth_module, "authenticate", in_thread)

    async def scenario() -> tuple[Any, int]:
        return await lookup.principal(key), threading.get_ident()

    try:
        who, loop_thread = asyncio.run(scenario())
    finally:
        engine.dispose()
    assert who is not None and who.tenant_id == "acme"
    assert len(calls) == 1 and calls[0] != loop_thread


def test_an_idle_pooled_connection_the_server_dropped_is_replaced(db_url, monkeypatch) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite connections are not dropped by a server")
    monkeypatch.setattr(db_module, "PING_AFTER_IDLE_S", 0.0)
    engine = make_engine(db_url)
    admin = make_engine(db_url)
    try:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            conn.commit()
        with engine.connect() as conn:  # the dead one fails its ping: a new connection answers
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        engine.dispose()
        admin.dispose()


def test_a_submission_counts_the_queue_after_one_in_flight_commits(store: JobStore) -> None:
    """Two transactions each insert a job of a tenant with room for one: the second's count waits for the first's
    commit and sees its job (on PostgreSQL the tenant's queue lock; on SQLite the write lock)."""
    with store.transaction() as conn:
        ensure_tenant(conn, "acme", max_queued=1)
    counted, committed = threading.Event(), threading.Event()

    def first() -> int:
        with store.transaction() as conn:
            _, quotas = store.create_queued_job(conn, tenant_id="acme", kind="train", gpus=1, config=CONFIG)
            counted.set()
            threading.Event().wait(0.5)  # the second submission arrives meanwhile
            committed.set()
        return quotas.queued

    def second() -> tuple[int, bool]:
        assert counted.wait(30)
        with store.transaction() as conn:
            _, quotas = store.create_queued_job(conn, tenant_id="acme", kind="train", gpus=1, config=CONFIG)
            waited = committed.is_set()
            conn.rollback()  # over the quota: the submission refuses and rolls back
        return quotas.queued, waited

    with ThreadPoolExecutor(2) as pool:
        one, two = pool.submit(first), pool.submit(second)
        assert one.result() == 1
        assert two.result() == (2, True)
