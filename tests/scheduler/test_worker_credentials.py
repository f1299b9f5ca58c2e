"""Workers are the cluster's principals: only an operator-made worker credential registers a worker or takes a lease,
within its bounds (devices by count and kind, models, tenants); a tenant's admin key is no worker; a worker that
takes leases and never runs them is quarantined before it can fail a job; the migration takes the worker scope
from tenants' keys. On SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from workerkit import Clock, auth, job_row, query, register, submit  # registered by conftest.py

from tinkergym.cli import main
from tinkergym.scheduler import leases
from tinkergym.scheduler.auth import KEY_PATTERN, key_digest
from tinkergym.scheduler.db import make_engine, tenants, upgrade


def _body(name: str = "w1", devices: int = 1, kind: str = "gpu", models: tuple[str, ...] = ("tiny",)) -> dict[str, Any]:
    return {"name": name, "host": "127.0.0.1", "devices": [{"index": i, "kind": kind} for i in range(devices)], "models": list(models)}


@pytest.fixture
def env(make_client: Any, keys: Any) -> Any:
    class Env:
        clock = Clock()
        client = make_client(clock=clock, lease_ttl_s=30.0)
        acme = keys.new("acme", "read,write")
        acme_admin = keys.new("acme", "admin")

    return Env()


# ----- who may act as a worker ----------------------------------------------------------------------------
def test_a_tenants_admin_key_neither_registers_nor_leases(env: Any, keys: Any) -> None:
    job_id = submit(env.client, env.acme)
    refused = env.client.post("/v1/workers", json=_body(), headers=auth(env.acme_admin))
    assert refused.status_code == 403 and "worker" in refused.json()["error"]["message"]
    # Even a worker id registered by a real credential: the admin key is not a worker.
    w = register(env.client, keys.worker(4), devices=1)
    assert env.client.post(f"/v1/workers/{w.id}/lease", headers=auth(env.acme_admin)).status_code == 403
    assert job_row(env.client.app.state.settings.db_url, job_id)["state"] == "queued"


def test_a_credential_bound_to_another_tenant_gets_no_lease_of_this_tenants_job(env: Any, keys: Any, db_url: str) -> None:
    job_id = submit(env.client, env.acme)
    globex_pool = register(env.client, keys.worker(4, tenants=("globex",)), name="globex-box", devices=1)
    assert globex_pool.lease() is None
    assert job_row(db_url, job_id)["state"] == "queued"
    acme_pool = register(env.client, keys.worker(4, tenants=("acme",)), name="acme-box", devices=1)
    lease = acme_pool.lease()
    assert lease is not None and lease["job_id"] == job_id
    # The globex pool runs globex's jobs.
    globex = keys.new("globex", "read,write")
    theirs = submit(env.client, globex)
    assert globex_pool.lease()["job_id"] == theirs


def test_a_tenant_admin_lists_only_the_workers_that_serve_it(env: Any, keys: Any) -> None:
    shared = register(env.client, keys.worker(2), name="shared", devices=1)
    mine = register(env.client, keys.worker(2, tenants=("acme",)), name="mine", devices=1)
    register(env.client, keys.worker(2, tenants=("globex",)), name="theirs", devices=1)
    listed = env.client.get("/v1/workers", headers=auth(env.acme_admin))
    assert listed.status_code == 200 and {w["id"] for w in listed.json()["workers"]} == {shared.id, mine.id}


# ----- bounds -----------------------------------------------------------------------------------------------
def test_a_credential_registers_no_more_devices_than_it_holds(env: Any, keys: Any, db_url: str) -> None:
    key = keys.worker(4, kind="gpu")
    too_many = env.client.post("/v1/workers", json=_body(devices=64), headers=auth(key))
    assert too_many.status_code == 403 and "4 device(s)" in too_many.json()["error"]["message"]
    assert env.client.post("/v1/workers", json=_body("a", devices=3), headers=auth(key)).status_code == 200
    # Across workers: 3 on "a" leave 1 for "b".
    second = env.client.post("/v1/workers", json=_body("b", devices=2), headers=auth(key))
    assert second.status_code == 403 and "3 on its other workers" in second.json()["error"]["message"]
    assert env.client.post("/v1/workers", json=_body("b", devices=1), headers=auth(key)).status_code == 200
    # Re-registering "a" with as many devices is an update, not more devices.
    assert env.client.post("/v1/workers", json=_body("a", devices=3), headers=auth(key)).status_code == 200
    active = sa.text("SELECT count(*) FROM devices WHERE active")
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(active).scalar_one() == 4
    finally:
        engine.dispose()


def test_re_registering_with_other_indexes_while_jobs_run_cannot_outgrow_the_bound(env: Any, keys: Any, db_url: str) -> None:
    """A credential for 2 devices leases 2 jobs, then registers the same worker (and a second one) with new indexes:
    the devices its jobs still hold count, so it never holds more than 2 jobs at once."""
    key = keys.worker(2)
    box = register(env.client, key, name="box", devices=2)
    jobs = [submit(env.client, env.acme) for _ in range(8)]
    held = [box.lease(), box.lease()]
    assert all(held) and box.lease() is None
    moved = {"name": "box", "host": "127.0.0.1", "devices": [{"index": i, "kind": "slot"} for i in (2, 3)], "models": ["tiny"]}
    refused = env.client.post("/v1/workers", json=moved, headers=auth(key))
    assert refused.status_code == 403 and "still held by jobs" in refused.json()["error"]["message"], refused.text
    one_more = {**moved, "devices": [{"index": 2, "kind": "slot"}]}
    assert env.client.post("/v1/workers", json=one_more, headers=auth(key)).status_code == 403
    other = env.client.post("/v1/workers", json={**moved, "name": "second"}, headers=auth(key))
    assert other.status_code == 403  # nor on another worker of the credential
    assert box.lease() is None
    running = [j for j in jobs if job_row(db_url, j)["state"] != "queued"]
    assert len(running) == 2, running
    # Its jobs end: the same move now fits, and it leases on the new indexes, two at a time.
    for lease in held:
        assert box.state(lease["job_id"], lease["epoch"], "failed", error="moved").status_code == 200
    assert env.client.post("/v1/workers", json=moved, headers=auth(key)).status_code == 200
    assert box.lease() is not None and box.lease() is not None and box.lease() is None


def test_a_credential_registers_only_its_kind_and_models(env: Any, keys: Any) -> None:
    key = keys.worker(4, kind="gpu", models=("tiny",))
    wrong_kind = env.client.post("/v1/workers", json=_body(kind="slot"), headers=auth(key))
    assert wrong_kind.status_code == 403 and "gpu devices only" in wrong_kind.json()["error"]["message"]
    other_model = env.client.post("/v1/workers", json=_body(models=("tiny", "org/big")), headers=auth(key))
    assert other_model.status_code == 403 and "org/big" in other_model.json()["error"]["message"]


def test_a_lease_offers_only_the_models_the_credential_allows(env: Any, keys: Any, db_url: str) -> None:
    key = keys.worker(4, models=("tiny",))
    w = register(env.client, key, devices=1, models=("tiny",))
    big = submit(env.client, env.acme, model="org/big")
    # The operator narrows the credential to another model: the worker's registered model no longer leases.
    from tinkergym.scheduler.credentials import WorkerBounds, set_worker_bounds

    engine = make_engine(db_url)
    try:
        key_id = KEY_PATTERN.match(key).group(1)
        assert set_worker_bounds(engine, key_id, WorkerBounds(4, models=("org/big",)))
    finally:
        engine.dispose()
    tiny = submit(env.client, env.acme)
    assert w.lease() is None
    assert job_row(db_url, big)["state"] == "queued" and job_row(db_url, tiny)["state"] == "queued"


# ----- the worker that never runs what it takes ----------------------------------------------------------
def test_a_worker_that_never_heartbeats_is_quarantined_before_it_fails_a_job(env: Any, keys: Any, db_url: str) -> None:
    app = env.client.app
    rogue = register(env.client, keys.worker(1), name="rogue", devices=1)
    job_id = submit(env.client, env.acme)
    for _ in range(2):
        lease = rogue.lease()
        assert lease is not None and lease["job_id"] == job_id
        env.clock.advance(31.0)
        assert leases.sweep(app) == 1
        row = job_row(db_url, job_id)
        assert row["state"] == "queued" and row["attempt"] == 0  # the worker's fault: no attempt of the job's is spent
    refused = rogue.post("/lease")
    assert refused.status_code == 403 and "quarantined" in refused.json()["error"]["message"]
    assert "workers release" in refused.json()["error"]["message"]
    # The owner reads why.
    found = env.client.get(f"/v1/jobs/{job_id}/events", headers=auth(env.acme)).json()["events"]
    notes = [e["data"] for e in found if e["type"] == "log" and e["data"].get("worker") == rogue.id]
    assert [n["strikes"] for n in notes] == [1, 2] and "quarantined" in notes[-1]["message"]
    # An honest worker runs the job, and its running job clears its own strikes.
    honest = register(env.client, keys.worker(1), name="honest", devices=1)
    lease = honest.lease()
    assert lease["job_id"] == job_id
    for state in ("starting", "running"):
        assert honest.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    # The operator reads why it is quarantined.
    quarantined = CliRunner().invoke(main, ["scheduler", "workers", "list", "--db", db_url])
    assert quarantined.exit_code == 0, quarantined.output
    line = next(line for line in quarantined.output.splitlines() if rogue.id in line)
    assert "quarantined" in line and "2 of its leases in a row expired before the job ran on it" in line
    # The operator releases the rogue: it leases again.
    cli = CliRunner().invoke(main, ["scheduler", "workers", "release", rogue.id, "--db", db_url])
    assert cli.exit_code == 0, cli.output
    assert rogue.post("/lease").status_code == 200
    listed = CliRunner().invoke(main, ["scheduler", "workers", "list", "--db", db_url])
    assert "quarantined" not in listed.output


def test_a_worker_that_ignores_a_cancel_loses_the_lease_at_the_deadline(make_client: Any, keys: Any, db_url: str) -> None:
    """The worker heartbeats on and never stops the cancelled job: at the deadline the lease ends, the job is cancelled,
    its device and the tenant's quota are free (the tenant's next job runs), and the worker's next heartbeat is 409."""
    clock = Clock()
    client = make_client(clock=clock, lease_ttl_s=30.0, cancel_deadline_s=100.0)
    owner = keys.new("acme", "read,write")
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.update(tenants).where(tenants.c.id == "acme").values(max_gpus=1))
    engine.dispose()
    w = register(client, keys.worker(2), devices=2)  # a free device: only the tenant's quota keeps its next job waiting
    job_id = submit(client, owner)
    lease = w.lease()
    for state in ("starting", "running"):
        assert w.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(owner)).json()["state"] == "cancelling"
    deadline = clock() + 100.0
    waiting = submit(client, owner)  # over the tenant's quota of one device while the cancelled job holds one
    for _ in range(4):  # 80 s of heartbeats, each inside the lease: the job stays cancelling, its lease shortened
        clock.advance(20.0)
        beat = w.heartbeat(job_id, lease["epoch"])
        assert beat.status_code == 200 and beat.json()["cancelling"] and beat.json()["expires_at"] <= deadline
    assert job_row(db_url, job_id)["state"] == "cancelling" and w.lease() is None
    clock.advance(21.0)  # past the deadline: the lease ended at it
    assert w.heartbeat(job_id, lease["epoch"]).status_code == 409
    assert leases.sweep(client.app) == 1
    assert job_row(db_url, job_id)["state"] == "cancelled"
    events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(owner)).json()["events"]
    assert any("did not report the cancelled job stopped" in str(e["data"].get("reason", "")) for e in events)
    assert w.lease()["job_id"] == waiting  # the device and the quota are free


def test_the_quarantine_reason_is_listed_on_one_short_line() -> None:
    from tinkergym.cli.scheduler.workers import quarantine_reason

    assert quarantine_reason({"quarantined": False, "quarantine_reason": None, "strikes": 0}) == "-"
    # Quarantined before migration 0005 stored reasons: its strikes say why.
    assert quarantine_reason({"quarantined": True, "quarantine_reason": None, "strikes": 3}).startswith("3 of its leases in a row")
    fault = "it gave job job_1 back: Traceback (most recent call last):\n" + "  File x\n" * 50 + "ModuleNotFoundError: uvicorn"
    shown = quarantine_reason({"quarantined": True, "quarantine_reason": fault, "strikes": 0})
    assert "\n" not in shown and len(shown) <= 120 and shown.startswith("it gave job job_1 back") and shown.endswith("uvicorn")


def test_strikes_reset_when_the_worker_runs_a_whole_lease_not_when_it_says_running(env: Any, keys: Any, db_url: str) -> None:
    app = env.client.app
    w = register(env.client, keys.worker(1), devices=1)
    for _ in range(3):
        submit(env.client, env.acme)
    lease = w.lease()
    env.clock.advance(31.0)
    leases.sweep(app)  # strike 1
    lease = w.lease()
    for state in ("starting", "running"):  # "running" alone proves nothing
        assert w.state(lease["job_id"], lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    for _ in range(2):  # a heartbeat of the running job a whole lease after the grant does
        env.clock.advance(20.0)
        assert w.heartbeat(lease["job_id"], lease["epoch"]).status_code == 200
    assert query(db_url, "SELECT strikes FROM workers WHERE id = :i", i=w.id) == [(0,)]
    assert w.state(lease["job_id"], lease["epoch"], "succeeded").status_code == 200
    lease = w.lease()
    env.clock.advance(31.0)
    leases.sweep(app)  # strike 1 again, not 2
    assert w.post("/lease").status_code == 200


def test_a_worker_that_reports_running_and_never_heartbeats_is_quarantined_and_fails_no_job(env: Any, keys: Any, db_url: str) -> None:
    """The rogue takes leases, reports ``running`` at a made-up URL at once and never heartbeats: each lease it loses is
    a strike (reporting running clears none), it is quarantined after two, and another tenant's jobs are queued again at
    their first attempt, then run by an honest worker."""
    app = env.client.app
    rogue = register(env.client, keys.worker(4), name="rogue", devices=4)
    globex = keys.new("globex", "read,write")
    jobs = [submit(env.client, globex) for _ in range(6)]
    refused = None
    for _ in range(10):
        lease = rogue.post("/lease")
        if lease.status_code == 403:
            refused = lease
            break
        if lease.json()["lease"] is None:  # all four devices held: their leases run out
            env.clock.advance(31.0)
            leases.sweep(app)
            continue
        taken = lease.json()["lease"]
        for state in ("starting", "running"):
            assert rogue.state(taken["job_id"], taken["epoch"], state, server_url="http://10.0.0.1:1").status_code == 200
    assert refused is not None and "quarantined" in refused.json()["error"]["message"]
    rows = [job_row(db_url, j) for j in jobs]
    assert all(r["state"] in ("queued", "leased", "running") for r in rows), [r["state"] for r in rows]
    env.clock.advance(31.0)
    leases.sweep(app)
    assert {(job_row(db_url, j)["state"], job_row(db_url, j)["attempt"]) for j in jobs} == {("queued", 0)}
    honest = register(env.client, keys.worker(1), name="honest", devices=1)
    lease = honest.lease()
    assert lease["job_id"] in jobs and lease["attempt"] == 0


def test_a_worker_that_loses_leases_after_proving_itself_is_quarantined_in_the_window(make_client: Any, keys: Any, db_url: str) -> None:
    """A subtler rogue heartbeats each job past its first lease (proving itself), then drops it, while it keeps asking
    for leases: at quarantine_losses losses in the window it is quarantined, and a job whose every lost lease was lost
    by it is queued again, not failed, although its attempts ran out."""
    clock = Clock()
    client = make_client(clock=clock, lease_ttl_s=30.0, quarantine_losses=3, quarantine_window_s=3600.0)
    owner = keys.new("acme", "read,write")
    rogue = register(client, keys.worker(1), name="rogue", devices=1)
    job_id = submit(client, owner)  # max_attempts 3
    for loss in (1, 2, 3):
        lease = rogue.lease()
        assert lease is not None and lease["job_id"] == job_id, (loss, lease)
        for state in ("starting", "running"):
            assert rogue.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
        for _ in range(2):
            clock.advance(20.0)
            assert rogue.heartbeat(job_id, lease["epoch"]).status_code == 200
        clock.advance(31.0)
        assert rogue.post("/lease").status_code in (200, 403)  # it keeps calling while its lease runs out
        assert leases.sweep(client.app) == 1
    row = job_row(db_url, job_id)
    assert row["state"] == "queued" and row["attempt"] == 2, row  # its attempts ran out, but every loss was the rogue's
    refused = rogue.post("/lease")
    assert refused.status_code == 403 and "lost 3 leases within 3600 s" in refused.json()["error"]["message"]
    honest = register(client, keys.worker(1), name="honest", devices=1)
    assert honest.lease()["job_id"] == job_id


def _running_jobs(client: Any, keys: Any, clock: Clock, count: int) -> tuple[Any, list[tuple[str, int]]]:
    """A 4-device worker running ``count`` of tenant acme's jobs, each heartbeated after it was reported running (its
    lease proven); the worker and the ``(job, epoch)`` it holds."""
    owner = keys.new("acme", "read,write")
    box = register(client, keys.worker(4), name="box", devices=4)
    held = []
    for _ in range(count):
        job_id = submit(client, owner)
        lease = box.lease()
        held.append((job_id, lease["epoch"]))
        for state in ("starting", "running"):
            assert box.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9").status_code == 200
    clock.advance(1.0)
    for job_id, epoch in held:
        assert box.heartbeat(job_id, epoch).status_code == 200
    return box, held


def test_a_worker_that_died_holding_leases_is_not_quarantined_for_them(make_client: Any, keys: Any, db_url: str) -> None:
    clock = Clock()
    client = make_client(clock=clock, lease_ttl_s=30.0, quarantine_losses=2)
    box, held = _running_jobs(client, keys, clock, 4)
    for _ in range(2):
        clock.advance(20.0)
        for job_id, epoch in held:
            assert box.heartbeat(job_id, epoch).status_code == 200
    clock.advance(31.0)  # the machine died: no more calls
    assert leases.sweep(client.app) == 4
    assert query(db_url, "SELECT quarantined_at, losses FROM workers WHERE id = :i", i=box.id) == [(None, 0)]
    assert {job_row(db_url, j)["attempt"] for j, _ in held} == {1}  # proven leases: each counts against its job


def test_leases_that_ran_out_while_the_scheduler_was_down_quarantine_nobody(make_client: Any, keys: Any, db_url: str) -> None:
    """The scheduler stops for longer than a lease; when it comes back, the worker calls before the sweep of the leases
    that ran out meanwhile: those losses are not the worker's (it is not quarantined), though they count for the jobs."""
    clock = Clock()
    first = make_client(clock=clock, lease_ttl_s=30.0, quarantine_losses=2)
    box, held = _running_jobs(first, keys, clock, 3)
    clock.advance(600.0)  # the scheduler was down for ten minutes; a new one starts on the same database
    second = make_client(clock=clock, lease_ttl_s=30.0, quarantine_losses=2)
    assert second.post(f"/v1/workers/{box.id}/lease", headers=auth(box.key)).status_code == 200  # before the sweep
    assert leases.sweep(second.app) == 3
    assert query(db_url, "SELECT quarantined_at, losses FROM workers WHERE id = :i", i=box.id) == [(None, 0)]
    assert {job_row(db_url, j)["attempt"] for j, _ in held} == {1}


# ----- the operator's commands ----------------------------------------------------------------------------
def test_worker_credentials_are_made_by_the_operator_only(db_url: str, tmp_path: Path) -> None:
    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, ["scheduler", *args, "--db", db_url, "--data-dir", str(tmp_path)])

    refused = cli("keys", "create", "--tenant", "acme", "--scopes", "read,worker")
    assert refused.exit_code == 2 and "workers create" in refused.output
    made = cli("workers", "create", "gpu-host-1", "--devices", "4", "--kind", "gpu", "--model", "tiny", "--tenant", "acme")
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert KEY_PATTERN.match(key) and made.stdout.count("tgk_") == 1 and "4 gpus" in made.stderr
    key_id = KEY_PATTERN.match(key).group(1)
    listed = cli("workers", "credentials")
    assert key_id in listed.stdout and "tenants: acme" in listed.stdout and key_digest(key) not in listed.stdout
    assert key_id not in cli("keys", "list").output  # tenants' keys only
    assert "_cluster" not in cli("tenants", "list").output  # the credentials' tenant holds no jobs: not listed
    changed = cli("workers", "set", key_id, "--devices", "8")
    assert changed.exit_code == 0 and "8 devices" in changed.stdout and "tenants: all" in changed.stdout
    assert cli("workers", "set", "ffffffffffff", "--devices", "1").exit_code == 2
    assert cli("keys", "revoke", key_id).exit_code == 0
    assert cli("workers", "release", "wkr_nope").exit_code == 2


# ----- the migration ----------------------------------------------------------------------------------------
def test_the_migration_takes_the_worker_scope_from_tenants_keys(empty_db_url: str, caplog: Any) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(engine, "0003")
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tenants (id, max_gpus, max_queued, created_at) VALUES ('acme', 8, 100, 0)"))
            for key_id, scopes in (("aaaaaaaaaaaa", "worker"), ("bbbbbbbbbbbb", "read,worker"), ("cccccccccccc", "admin"),
                                   ("dddddddddddd", "read,write")):
                conn.execute(sa.text("INSERT INTO api_keys (id, tenant_id, digest, scopes, name, created_at) "
                                     "VALUES (:id, 'acme', :d, :s, '', 0)"), {"id": key_id, "d": "0" * 64, "s": scopes})
        with caplog.at_level(logging.WARNING):
            upgrade(engine)
        with engine.connect() as conn:
            rows = {r.id: (r.scopes, r.revoked_at is not None) for r in conn.execute(sa.text("SELECT id, scopes, revoked_at FROM api_keys"))}
    finally:
        engine.dispose()
    assert rows == {"aaaaaaaaaaaa": ("", True), "bbbbbbbbbbbb": ("read", False), "cccccccccccc": ("admin", False),
                    "dddddddddddd": ("read,write", False)}
    warned = caplog.text
    assert "aaaaaaaaaaaa" in warned and "revoked" in warned and "bbbbbbbbbbbb" in warned and "cccccccccccc" in warned
    assert "dddddddddddd" not in warned and "workers create" in warned


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the answer reads the key alone: the tests above cover PostgreSQL
def test_a_worker_started_with_a_tenants_key_says_to_make_a_worker_credential(db_url: str, keys: Any, tmp_path: Path) -> None:
    """``tinkergym worker`` with a tenant's key exits 2 naming the command that makes a worker credential, not a scope to
    ask for (no key of a tenant registers a worker, whatever its scopes)."""
    from tinkergym.scheduler.app import SchedulerSettings, create_app
    from tinkergym.serve.asgi import ThreadServer

    live = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    try:
        for scopes in ("read,write", "admin"):
            result = CliRunner().invoke(main, ["worker", "--scheduler", live.url, "--slots", "1", "--models", "tiny",
                                               "--work-dir", str(tmp_path / "w")], env={"TINKERGYM_API_KEY": keys.new("acme", scopes)})
            said = " ".join(result.output.split())
            assert result.exit_code == 2, said
            assert "not a worker credential" in said and "tinkergym scheduler workers create NAME --devices N" in said, said
            assert "'worker' scope" not in said and "that scope" not in said, said
    finally:
        live.stop()
