"""Tenant quotas on what a tenant can grow, on SQLite and PostgreSQL: events per job (429) and one event's size (413)
for the events clients and workers send, never for the scheduler's own; the bytes a tenant's artifacts store (413),
counted exactly through uploads, replacements and deletes; ended jobs kept per tenant. Each refusal names the quota
and the ``tinkergym scheduler tenants set`` command that raises it, and the same request passes once it is raised.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from tinkergym.scheduler import quotas, retention
from tinkergym.scheduler.artifacts import sweep_artifacts
from workerkit import Clock, auth, query, register, submit  # registered by conftest.py

from tinkergym.cli import main
from tinkergym.scheduler.bounds import CLUSTER
from tinkergym.scheduler.db import make_engine, tenants

DAY = 86400.0


def tenants_set(db_url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["scheduler", "tenants", "set", *args, "--db", db_url])
    assert result.exit_code == 0, result.output
    return result.stdout


class Env:
    """A scheduler on a fake clock, tenant acme's owner key and a worker."""

    def __init__(self, make_client: Any, keys: Any, tmp_path: Path, **settings: Any) -> None:
        self.clock = Clock()
        self.client = make_client(clock=self.clock, **settings)
        self.owner = keys.new("acme", "read,write")
        self.worker = register(self.client, keys.new("acme", "worker"), devices=4)
        self.root = tmp_path / "data" / "jobs"

    def run(self, owner: str | None = None, **extra: Any) -> tuple[str, int]:
        """A job leased to the worker and running: (job id, epoch)."""
        job_id = submit(self.client, owner or self.owner, **extra)
        lease = self.worker.lease()
        assert lease is not None and lease["job_id"] == job_id
        for state in ("starting", "running"):
            assert self.worker.state(job_id, lease["epoch"], state, server_url="http://127.0.0.1:9/").status_code == 200
        return job_id, lease["epoch"]

    def client_event(self, job_id: str, data: dict[str, Any]) -> Any:
        return self.client.post(f"/v1/jobs/{job_id}/client-events", json={"type": "metrics", "data": data}, headers=auth(self.owner))

    def worker_event(self, job_id: str, epoch: int, data: dict[str, Any], key: str | None = None) -> Any:
        return self.worker.post(f"/jobs/{job_id}/events", {"epoch": epoch, "type": "log", "data": data},
                                headers={"Idempotency-Key": key} if key else None)

    def upload(self, job_id: str, epoch: int, name: str, path: str, body: bytes | Iterator[bytes]) -> Any:
        url = f"/v1/workers/{self.worker.id}/jobs/{job_id}/artifacts/{name}/{path}"
        return self.client.put(url, content=body, params={"epoch": epoch}, headers=auth(self.worker.key))

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}, headers=auth(self.owner)).json()["events"]

    def disk_bytes(self, job_id: str) -> int:
        folder = self.root / job_id
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(folder).parts)) if folder.exists() else 0


def counted(db_url: str, job_id: str) -> int:
    return query(db_url, "SELECT artifact_bytes FROM jobs WHERE id = :j", j=job_id)[0][0]


def refused(response: Any, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "quota", error
    for word in words:
        assert word in error["message"], error["message"]
    return error["message"]


@pytest.fixture
def env(make_client: Any, keys: Any, tmp_path: Path) -> Env:
    return Env(make_client, keys, tmp_path)


# ----- events ----------------------------------------------------------------------------------------------
def event_count(db_url: str, job_id: str) -> int:
    return query(db_url, "SELECT COUNT(*) FROM events WHERE job_id = :j", j=job_id)[0][0]


def test_events_past_a_jobs_quota_are_429_until_it_is_raised_and_a_refusal_is_not_replayed(env: Env, db_url: str) -> None:
    job_id, epoch = env.run()
    cap = event_count(db_url, job_id) + 2  # the scheduler's own events so far count too
    tenants_set(db_url, "acme", "--max-events-per-job", str(cap))
    assert env.client_event(job_id, {"step": 1}).status_code == 200
    assert env.worker_event(job_id, epoch, {"message": "one"}).status_code == 200
    refused(env.client_event(job_id, {"step": 2}), 429, f"job {job_id} holds {cap} events", f"tenant acme's max_events_per_job ({cap})",
            "raise it with: tinkergym scheduler tenants set acme --max-events-per-job")
    refused(env.worker_event(job_id, epoch, {"message": "two"}, key="k-two"), 429, "max_events_per_job")
    assert event_count(db_url, job_id) == cap
    raised = tenants_set(db_url, "acme", "--max-events-per-job", str(cap + 2))
    assert f"max_events_per_job={cap + 2}" in raised, raised
    assert env.client_event(job_id, {"step": 2}).status_code == 200
    again = env.worker_event(job_id, epoch, {"message": "two"}, key="k-two")  # the same key: runs now, not a stored 429
    assert again.status_code == 200 and "Idempotent-Replayed" not in again.headers, again.text
    assert again.json()["seq"] == cap + 2
    refused(env.client_event(job_id, {"step": 3}), 429, f"holds {cap + 2} events")


def test_the_schedulers_own_events_are_recorded_past_the_quota(env: Env, db_url: str) -> None:
    job_id, epoch = env.run()
    cap = event_count(db_url, job_id) + 1
    tenants_set(db_url, "acme", "--max-events-per-job", str(cap))
    assert env.worker_event(job_id, epoch, {"message": "last one that fits"}).status_code == 200
    refused(env.worker_event(job_id, epoch, {"message": "over"}), 429, "max_events_per_job")
    cancel = env.client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(env.owner))
    assert cancel.status_code == 200 and cancel.json()["state"] == "cancelling", cancel.text
    assert env.worker.state(job_id, epoch, "cancelled").status_code == 200
    states = [e["data"]["state"] for e in env.events(job_id) if e["type"] == "state"]
    assert states[-2:] == ["cancelling", "cancelled"]
    assert query(db_url, "SELECT COUNT(*), MAX(seq) FROM events WHERE job_id = :j", j=job_id) == [(cap + 2, cap + 2)]


def test_an_event_over_the_tenants_size_quota_is_413_until_it_is_raised(env: Env, db_url: str) -> None:
    job_id, epoch = env.run()
    assert env.client_event(job_id, {"text": "x" * 20_000}).status_code == 200  # past the old fixed 16 KiB: the quota rules
    big = {"text": "x" * 70_000}
    refused(env.client_event(job_id, big), 413, "max_event_bytes (65,536)", "--max-event-kb 69")
    tenants_set(db_url, "acme", "--max-event-kb", "1")
    small = {"message": "y" * 1500}
    message = refused(env.worker_event(job_id, epoch, small, key="k-small"), 413, "1,515 bytes as JSON", "tenant acme's max_event_bytes (1,024)",
                      "tinkergym scheduler tenants set acme --max-event-kb 2")
    refused(env.client_event(job_id, small), 413, "max_event_bytes")
    assert "--max-event-kb" in message
    raised = tenants_set(db_url, "acme", "--max-event-kb", "2")
    assert "max_event_kb=2" in raised
    assert env.worker_event(job_id, epoch, small, key="k-small").status_code == 200
    assert env.client_event(job_id, small).status_code == 200


# ----- artifact bytes --------------------------------------------------------------------------------------
def test_uploads_past_the_tenants_stored_bytes_are_413_until_it_is_raised(env: Env, db_url: str) -> None:
    tenants_set(db_url, "acme", "--max-artifact-gb", "0.000001")  # 1,074 bytes
    job_id, epoch = env.run()
    assert env.upload(job_id, epoch, "step_1", "weights.bin", b"w" * 1000).status_code == 200
    message = refused(env.upload(job_id, epoch, "step_1", "state.json", b"s" * 100), 413, "tenant acme's stored artifacts to 1,100 bytes",
                      "max_artifact_bytes (1,074)", "tinkergym scheduler tenants set acme --max-artifact-gb 1")
    assert not (env.root / job_id / "step_1" / "state.json").exists() and counted(db_url, job_id) == 1000
    # No Content-Length (a chunked body): refused when it commits, and nothing of it stays.
    refused(env.upload(job_id, epoch, "step_1", "state.json", iter([b"s" * 50, b"s" * 50])), 413, "max_artifact_bytes")
    assert not (env.root / job_id / "step_1" / "state.json").exists() and counted(db_url, job_id) == 1000
    # Another job of the tenant counts too.
    other, other_epoch = env.run()
    refused(env.upload(other, other_epoch, "step_1", "weights.bin", b"o" * 100), 413, f"for job {other}")
    assert "--max-artifact-gb" in message
    tenants_set(db_url, "acme", "--max-artifact-gb", "0.000002")  # 2,147 bytes
    assert env.upload(job_id, epoch, "step_1", "state.json", b"s" * 100).status_code == 200
    assert env.upload(other, other_epoch, "step_1", "weights.bin", b"o" * 100).status_code == 200
    listed = CliRunner().invoke(main, ["scheduler", "tenants", "list", "--db", db_url])
    header, *rows = [line.split() for line in listed.stdout.splitlines()]
    assert header[:8] == ["TENANT", "MAX_GPUS", "MAX_QUEUED", "MAX_ARTIFACT_GB", "STORED_GB", "MAX_EVENTS_PER_JOB", "MAX_EVENT_KB",
                          "KEEP_ENDED_JOBS"], listed.output
    assert [r[:8] for r in rows if r[0] == "acme"] == [["acme", "8", "100", "2e-06", "1.12e-06", "100000", "64", "1000"]], listed.output


def test_replacing_a_file_counts_its_new_size_only(env: Env, db_url: str) -> None:
    tenants_set(db_url, "acme", "--max-artifact-gb", "0.000001")  # 1,074 bytes
    job_id, epoch = env.run()
    assert env.upload(job_id, epoch, "step_1", "weights.bin", b"a" * 1000).status_code == 200
    assert env.upload(job_id, epoch, "step_1", "weights.bin", b"b" * 1050).status_code == 200  # fits: it replaces 1,000 bytes
    assert counted(db_url, job_id) == 1050 == env.disk_bytes(job_id)
    assert env.upload(job_id, epoch, "step_1", "weights.bin", b"c" * 10).status_code == 200
    assert counted(db_url, job_id) == 10 == env.disk_bytes(job_id)


def test_artifact_bytes_stay_exact_through_uploads_replacements_and_deletes(make_client: Any, keys: Any, tmp_path: Path,
                                                                           db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, checkpoint_keep_s=3600.0, artifact_retention_s=30 * DAY, lease_ttl_s=1e9)
    job_id, epoch = env.run()
    for step, size in ((1, 300), (2, 500), (3, 700)):
        name = f"step_{step}"
        assert env.upload(job_id, epoch, name, "weights.bin", b"w" * size).status_code == 200
        assert env.upload(job_id, epoch, name, "nested/state.json", b"{}").status_code == 200
        assert env.worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": step, "name": name}).status_code == 200
    assert env.upload(job_id, epoch, "step_2", "weights.bin", b"x").status_code == 409  # recorded: unchanged
    assert env.upload(job_id, epoch, "partial", "weights.bin", b"p" * 900).status_code == 200
    assert env.upload(job_id, epoch, "partial", "weights.bin", b"p" * 400).status_code == 200
    assert counted(db_url, job_id) == 300 + 500 + 700 + 3 * 2 + 400 == env.disk_bytes(job_id)
    deleted = env.client.delete(f"/v1/workers/{env.worker.id}/jobs/{job_id}/artifacts/partial", params={"epoch": epoch},
                                headers=auth(env.worker.key))
    assert deleted.status_code == 204, deleted.text
    assert counted(db_url, job_id) == 1506 == env.disk_bytes(job_id)
    assert env.upload(job_id, epoch, "partial", "weights.bin", b"p" * 50).status_code == 200  # left behind when the job ends
    assert env.worker.state(job_id, epoch, "succeeded").status_code == 200
    env.clock.advance(3601.0)
    assert sweep_artifacts(env.client.app)["pruned"] == 2  # the newest checkpoint stays, the rest goes
    assert counted(db_url, job_id) == 702 == env.disk_bytes(job_id)
    env.clock.advance(30 * DAY)
    assert sweep_artifacts(env.client.app)["expired"] == 1
    assert counted(db_url, job_id) == 0 == env.disk_bytes(job_id)


def test_the_retention_pass_counts_files_stored_before_bytes_were_counted(make_client: Any, keys: Any, tmp_path: Path,
                                                                         db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, checkpoint_keep_s=3600.0)
    job_id, epoch = env.run()
    assert env.upload(job_id, epoch, "step_1", "weights.bin", b"w" * 123).status_code == 200
    assert env.worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 1, "name": "step_1"}).status_code == 200
    assert env.worker.state(job_id, epoch, "succeeded").status_code == 200
    engine = env.client.app.state.engine
    with engine.begin() as conn:  # as a job of an older version left it
        conn.exec_driver_sql(f"UPDATE jobs SET artifact_bytes = 0 WHERE id = '{job_id}'")
    env.clock.advance(60.0)
    sweep_artifacts(env.client.app)
    assert counted(db_url, job_id) == 123


def test_two_commits_at_once_cannot_both_take_the_last_bytes(env: Env, db_url: str) -> None:
    """Two uploads whose early checks both passed: the second commit waits for the first (the tenant's row is locked)
    and then finds its bytes taken."""
    tenants_set(db_url, "acme", "--max-artifact-gb", "0.000001")  # 1,074 bytes
    first, _ = env.run()
    second, _ = env.run()
    store = env.client.app.state.store
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def commit(job_id: str, hold: bool) -> None:
        try:
            with store.transaction() as conn:
                quotas.charge_upload(conn, store.get(conn, job_id, for_update=True), 700, 0)
                if hold:  # the first commit's transaction stays open while the second one starts
                    holding.set()
                    release.wait(timeout=60)
            outcome[job_id] = 200
        except quotas.QuotaExceeded as exc:
            outcome[job_id] = exc.status

    one = threading.Thread(target=commit, args=(first, True))
    one.start()
    assert holding.wait(timeout=60)
    two = threading.Thread(target=commit, args=(second, False))
    two.start()
    two.join(timeout=1.0)  # without the lock it would count now, beside the open transaction
    release.set()
    one.join(timeout=60)
    two.join(timeout=60)
    assert outcome == {first: 200, second: 413}
    assert counted(db_url, first) == 700 and counted(db_url, second) == 0


# ----- ended jobs kept ---------------------------------------------------------------------------------------
def test_each_tenant_keeps_its_newest_ended_jobs_and_any_that_a_live_job_continues(env: Env, keys: Any, db_url: str) -> None:
    tenants_set(db_url, "acme", "--keep-ended-jobs", "2")
    continued, epoch = env.run()  # the oldest ended job, with files: a live job continues it
    assert env.upload(continued, epoch, "step_1", "weights.bin", b"w").status_code == 200
    assert env.worker.state(continued, epoch, "failed", error="x").status_code == 200
    ended = []
    for _ in range(4):
        env.clock.advance(10.0)
        job_id = submit(env.client, env.owner)
        assert env.client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(env.owner)).json()["state"] == "cancelled"
        ended.append(job_id)
    live = submit(env.client, env.owner, config={"model": "tiny", "resume_job": continued})
    other = keys.new("other", "read,write")
    theirs = submit(env.client, other)
    assert env.client.post(f"/v1/jobs/{theirs}/cancel", headers=auth(other)).status_code == 200
    assert retention.sweep_jobs(env.client.app)["jobs"] == 2
    kept = {r[0] for r in query(db_url, "SELECT id FROM jobs")}
    assert kept == {ended[2], ended[3], continued, live, theirs}
    assert query(db_url, "SELECT COUNT(*) FROM events WHERE job_id IN (:a, :b)", a=ended[0], b=ended[1]) == [(0,)]
    assert env.client.get(f"/v1/jobs/{ended[0]}", headers=auth(env.owner)).status_code == 404
    assert (env.root / continued / "step_1" / "weights.bin").exists()
    assert retention.sweep_jobs(env.client.app)["jobs"] == 0


# ----- idempotency records -----------------------------------------------------------------------------------
def test_idempotency_records_past_the_tenants_bounds_are_429_with_retry_after_and_counted_in_its_usage(env: Env, db_url: str) -> None:
    """One write key sends requests under new Idempotency-Keys again and again (each stores its answer): past the
    tenant's bound the next new key is 429 with Retry-After (when the oldest record expires) and runs nothing, a stored
    key is still answered, a request without a key still runs, and the records are in the tenant's usage."""
    tenants_set(db_url, "acme", "--max-idempotency-records", "5")

    def post(key: str | None) -> Any:
        body = {"kind": "train", "config": {"model": "tiny"}}
        return env.client.post("/v1/jobs", json=body, headers={**auth(env.owner), **({"Idempotency-Key": key} if key else {})})

    for i in range(5):
        env.clock.advance(10.0)
        assert post(f"k{i}").status_code == 201
    over = post("k5")
    message = refused(over, 429, "5 records", "--max-idempotency-records")
    assert int(over.headers["Retry-After"]) == DAY - 40, (over.headers, message)  # the oldest (k0) was stored 40 s ago
    assert query(db_url, "SELECT COUNT(*) FROM jobs WHERE tenant_id = 'acme'")[0][0] == 5  # the refused request made nothing
    again = post("k0")
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert post(None).status_code == 201  # without a key, requests still run
    usage = env.client.get("/v1/usage", headers=auth(env.owner)).json()["tenants"][0]
    assert usage["idempotency_records"] == 5 and usage["max_idempotency_records"] == 5
    assert 0 < usage["idempotency_bytes"] == query(db_url, "SELECT SUM(LENGTH(response)) FROM idempotency WHERE tenant_id = 'acme'")[0][0]
    # A worker credential is no tenant: its heartbeats and reports (each with a key) are never refused for records.
    engine = make_engine(db_url)
    with engine.begin() as conn:  # the worker credentials' tenant, held to one record
        assert conn.execute(sa.update(tenants).where(tenants.c.id == CLUSTER).values(max_idempotency_records=1)).rowcount == 1
    engine.dispose()
    lease = env.worker.lease()  # one of the jobs posted above
    job_id, epoch = lease["job_id"], lease["epoch"]
    for i in range(3):
        beat = env.worker.post(f"/jobs/{job_id}/heartbeat", {"epoch": epoch}, headers={"Idempotency-Key": f"beat-{i}"})
        assert beat.status_code == 200, beat.text
    # By bytes: a bound below what the records hold refuses the next new key too.
    tenants_set(db_url, "acme", "--max-idempotency-records", "1000", "--max-idempotency-mb", "0")
    refused(post("k6"), 429, "bytes of stored answers", "--max-idempotency-mb")
    # The records expire (the retention pass): new keys run again.
    tenants_set(db_url, "acme", "--max-idempotency-mb", "64")
    env.clock.advance(DAY)
    retention.sweep_jobs(env.client.app)
    assert post("k7").status_code == 201
    assert query(db_url, "SELECT COUNT(*) FROM idempotency WHERE tenant_id = 'acme'")[0][0] == 1
