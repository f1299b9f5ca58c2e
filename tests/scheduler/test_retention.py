"""Artifact retention, with the app's clock moved: an ended job keeps only its newest checkpoint after
``checkpoint_keep_s`` and nothing after ``artifact_retention_s`` (its row stays, an event says why); a job that a
live job continues keeps its newest; a job that has not ended is never touched, its uploads in progress included;
the app's background sweeper runs it; ``tinkergym scheduler serve`` takes the settings.

Job retention: an ended job is deleted with its events, checkpoints and files after ``job_retention_s`` (never one
that has not ended, nor one a live job continues), and Idempotency-Key records after ``idempotency_ttl_s``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tinkergym.scheduler import retention
from tinkergym.scheduler.artifacts import retention_due, sweep_artifacts
from workerkit import Clock, auth, query, register, submit  # registered by conftest.py

from tinkergym.cli import main

HOUR, DAY = 3600.0, 86400.0


class Env:
    """A scheduler on a fake clock (keep 1 h, retention 30 days) with an owner key and a worker."""

    def __init__(self, make_client: Any, keys: Any, tmp_path: Path, **settings: Any) -> None:
        self.clock = Clock()
        self.client = make_client(clock=self.clock, **{"checkpoint_keep_s": HOUR, "artifact_retention_s": 30 * DAY, **settings})
        self.owner = keys.new("acme", "read,write")
        self.worker = register(self.client, keys.new("acme", "worker"), devices=4)
        self.root = tmp_path / "data" / "jobs"

    def run(self, config: dict[str, Any] | None = None) -> tuple[str, int]:
        """A job leased to the worker and running: (job id, epoch)."""
        job_id = submit(self.client, self.owner, **({"config": config} if config else {}))
        lease = self.worker.lease()
        assert lease is not None and lease["job_id"] == job_id
        epoch = lease["epoch"]
        assert self.worker.state(job_id, epoch, "starting").status_code == 200
        assert self.worker.state(job_id, epoch, "running", server_url="http://127.0.0.1:9/").status_code == 200
        return job_id, epoch

    def upload(self, job_id: str, epoch: int, name: str, path: str = "weights.bin", body: bytes = b"w") -> None:
        url = f"/v1/workers/{self.worker.id}/jobs/{job_id}/artifacts/{name}/{path}"
        response = self.client.put(url, content=body, params={"epoch": epoch}, headers=auth(self.worker.key))
        assert response.status_code == 200, response.text

    def checkpoint(self, job_id: str, epoch: int, step: int) -> str:
        name = f"step_{step:06d}"
        self.upload(job_id, epoch, name, body=f"step {step}".encode())
        self.upload(job_id, epoch, name, "state.json", b"{}")
        response = self.worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": step, "name": name})
        assert response.status_code == 200, response.text
        return name

    def end(self, job_id: str, epoch: int, state: str = "succeeded") -> None:
        assert self.worker.state(job_id, epoch, state, **({"error": "x"} if state == "failed" else {})).status_code == 200

    def recorded(self, db_url: str, job_id: str) -> list[str]:
        return [r[0] for r in query(db_url, "SELECT name FROM checkpoints WHERE job_id = :j ORDER BY step", j=job_id)]

    def on_disk(self, job_id: str) -> list[str]:
        folder = self.root / job_id
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.exists() else []

    def sweep(self) -> dict[str, int]:
        return sweep_artifacts(self.client.app)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.client.get(f"/v1/jobs/{job_id}/events", headers=auth(self.owner)).json()["events"]

    def download(self, job_id: str, name: str, path: str = "weights.bin") -> Any:
        return self.client.get(f"/v1/jobs/{job_id}/artifacts/{name}/{path}", headers=auth(self.owner))


@pytest.fixture
def env(make_client: Any, keys: Any, tmp_path: Path) -> Env:
    return Env(make_client, keys, tmp_path)


@pytest.mark.slow
def test_older_checkpoints_of_an_ended_job_go_after_the_keep_time_the_newest_stays(env: Env, db_url: str) -> None:
    job_id, epoch = env.run()
    names = [env.checkpoint(job_id, epoch, step) for step in (10, 30, 20)]
    env.upload(job_id, epoch, "step_000040")  # a partial upload the job never recorded
    env.end(job_id, epoch)
    lone, lone_epoch = env.run()  # another ended job: one checkpoint and a stray folder
    env.checkpoint(lone, lone_epoch, 5)
    env.upload(lone, lone_epoch, "stray")
    env.end(lone, lone_epoch, "failed")
    env.clock.advance(HOUR - 1.0)
    assert env.sweep() == {"pruned": 0, "expired": 0, "removed": 0}
    assert env.recorded(db_url, job_id) == names[:1] + names[2:] + names[1:2] and len(env.on_disk(job_id)) == 4
    env.clock.advance(2.0)
    assert env.sweep() == {"pruned": 2, "expired": 0, "removed": 1}  # the stray folder of the other job
    assert env.recorded(db_url, job_id) == ["step_000030"] and env.on_disk(job_id) == ["step_000030"]
    assert not (env.root / job_id / ".sha256" / "step_000010").exists()
    assert env.download(job_id, "step_000030").content == b"step 30"
    assert env.download(job_id, "step_000010").status_code == 404
    assert env.recorded(db_url, lone) == ["step_000005"] and env.on_disk(lone) == ["step_000005"]
    pruned = [e for e in env.events(job_id) if e["data"].get("artifacts") == "pruned"]
    assert len(pruned) == 1 and pruned[0]["data"]["kept"] == "step_000030"
    assert env.sweep() == {"pruned": 0, "expired": 0, "removed": 0}  # nothing left to do: no event again
    # The owner's listing of checkpoints shows only what is kept.
    listed = env.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(env.owner))
    assert listed.status_code == 200 and [c["name"] for c in listed.json()["checkpoints"]] == ["step_000030"]


def test_everything_goes_after_the_retention_time_and_the_job_says_so(env: Env, db_url: str) -> None:
    job_id, epoch = env.run()
    for step in (1, 2):
        env.checkpoint(job_id, epoch, step)
    env.upload(job_id, epoch, "partial")
    env.end(job_id, epoch, "failed")
    env.clock.advance(30 * DAY - 1.0)
    env.sweep()
    assert env.recorded(db_url, job_id) == ["step_000002"]  # pruned, not expired yet
    env.clock.advance(2.0)
    assert env.sweep()["expired"] == 1
    assert env.recorded(db_url, job_id) == [] and not (env.root / job_id).exists()
    shown = env.client.get(f"/v1/jobs/{job_id}", headers=auth(env.owner))
    assert shown.status_code == 200 and shown.json()["state"] == "failed"  # the job row stays
    expired = [e for e in env.events(job_id) if e["data"].get("artifacts") == "expired"]
    assert len(expired) == 1 and "expired" in expired[0]["data"]["message"]
    assert env.download(job_id, "step_000002").status_code == 404


def test_a_job_that_a_live_job_continues_keeps_its_newest_until_that_job_ends(env: Env, db_url: str) -> None:
    first, epoch = env.run()
    for step in (1, 2, 3):
        env.checkpoint(first, epoch, step)
    env.end(first, epoch, "failed")
    env.clock.advance(31 * DAY)
    # `tinkergym train --resume` of the ended job: a new job continues it (queued: the worker's devices are free).
    second = submit(env.client, env.owner, config={"model": "tiny", "resume_job": first})
    env.sweep()
    assert env.recorded(db_url, first) == ["step_000003"] and env.on_disk(first) == ["step_000003"]
    lease = env.worker.lease()
    assert lease["job_id"] == second
    env.clock.advance(31 * DAY)
    env.sweep()  # running now: still kept
    base = f"/v1/workers/{env.worker.id}/jobs/{second}"
    found = env.client.get(f"{base}/checkpoints", params={"epoch": lease["epoch"]}, headers=auth(env.worker.key)).json()["checkpoints"]
    assert [(c["job_id"], c["name"]) for c in found] == [(first, "step_000003")]
    got = env.client.get(f"{base}/artifacts/step_000003/weights.bin", params={"epoch": lease["epoch"], "source": first},
                         headers=auth(env.worker.key))
    assert got.status_code == 200 and got.content == b"step 3"
    assert env.worker.state(second, lease["epoch"], "starting").status_code == 200
    assert env.worker.state(second, lease["epoch"], "failed", error="x").status_code == 200
    assert env.sweep()["expired"] == 1  # nobody continues it any more
    assert env.recorded(db_url, first) == [] and env.on_disk(first) == []
    assert env.on_disk(second) == []  # the second job ended just now and stored nothing: untouched either way


def test_a_running_job_is_never_touched_and_its_upload_in_progress_completes(make_client: Any, keys: Any, tmp_path: Path,
                                                                             db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, lease_ttl_s=1e9, checkpoint_keep_s=1.0, artifact_retention_s=2.0)
    job_id, epoch = env.run()
    for step in (1, 2, 3):
        env.checkpoint(job_id, epoch, step)
    env.upload(job_id, epoch, "step_000004")  # one file of a checkpoint still being uploaded
    store = env.client.app.state.artifacts
    writer = store.open_upload(job_id, "step_000004", "state.json", 1 << 20)  # a file in flight
    writer.write(b'{"step":')
    env.clock.advance(365 * DAY)
    assert env.sweep() == {"pruned": 0, "expired": 0, "removed": 0}
    assert env.recorded(db_url, job_id) == ["step_000001", "step_000002", "step_000003"]
    assert env.on_disk(job_id) == ["step_000001", "step_000002", "step_000003", "step_000004"]
    writer.write(b" 4}")
    info = writer.commit()
    assert info.size == len(b'{"step": 4}')
    response = env.worker.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 4, "name": "step_000004"})
    assert response.status_code == 200, response.text
    listing = env.client.get(f"/v1/jobs/{job_id}/artifacts/step_000004", headers=auth(env.owner)).json()
    assert sorted(f["path"] for f in listing["files"]) == ["state.json", "weights.bin"]
    assert env.download(job_id, "step_000004", "state.json").content == b'{"step": 4}'


def test_zero_turns_retention_off(make_client: Any, keys: Any, tmp_path: Path, db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, checkpoint_keep_s=0, artifact_retention_s=0)
    job_id, epoch = env.run()
    for step in (1, 2):
        env.checkpoint(job_id, epoch, step)
    env.end(job_id, epoch)
    env.clock.advance(365 * DAY)
    assert not retention_due(env.client.app)
    assert env.sweep() == {"pruned": 0, "expired": 0, "removed": 0}
    assert env.recorded(db_url, job_id) == ["step_000001", "step_000002"]


def test_the_background_sweeper_runs_retention_rate_limited(make_client: Any, keys: Any, tmp_path: Path, db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, background=True, sweep_interval_s=0.05, retention_interval_s=60.0, lease_ttl_s=1e9)
    job_id, epoch = env.run()
    for step in (1, 2):
        env.checkpoint(job_id, epoch, step)
    env.end(job_id, epoch)
    deadline = time.monotonic() + 10.0
    while getattr(env.client.app.state, "retention_ran_at", None) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    ran_at = env.client.app.state.retention_ran_at
    env.clock.advance(HOUR + 1.0)
    deadline = time.monotonic() + 20.0
    while (len(env.recorded(db_url, job_id)) > 1 or len(env.on_disk(job_id)) > 1) and time.monotonic() < deadline:
        time.sleep(0.05)  # no request: the app's background task does it (rows first, then files)
    assert env.recorded(db_url, job_id) == ["step_000002"] and env.on_disk(job_id) == ["step_000002"]
    last = env.client.app.state.retention_ran_at
    assert last > ran_at
    time.sleep(0.5)  # ten sweeps, no retention pass: the clock has not moved a minute
    assert env.client.app.state.retention_ran_at == last


def test_serve_takes_the_settings_and_refuses_a_worker_timeout_below_the_lease_ttl(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["scheduler", "serve", "--help"])
    for option in ("--checkpoint-keep", "--artifact-retention", "--retention-interval", "--worker-timeout", "--forget-workers-after",
                   "--job-retention", "--idempotency-ttl"):
        assert option in result.output
    bad = CliRunner().invoke(main, ["scheduler", "serve", "--lease-ttl", "30", "--worker-timeout", "10", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--worker-timeout" in bad.output


# ----- job retention ---------------------------------------------------------------------------------------
def test_ended_jobs_go_after_the_job_retention_with_their_events_checkpoints_and_files(make_client: Any, keys: Any, tmp_path: Path,
                                                                                      db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, job_retention_s=90 * DAY, lease_ttl_s=1e9)
    old, epoch = env.run()
    env.checkpoint(old, epoch, 1)
    env.end(old, epoch)
    continued, epoch = env.run()
    env.checkpoint(continued, epoch, 1)
    env.end(continued, epoch, "failed")
    waiting = submit(env.client, env.owner, config={"model": "tiny", "resume_job": continued})  # queued: never leased
    env.clock.advance(90 * DAY - 1.0)
    assert retention.sweep_jobs(env.client.app)["jobs"] == 0
    env.clock.advance(2.0)
    assert retention.sweep_jobs(env.client.app)["jobs"] == 1
    for table in ("jobs", "events", "checkpoints", "allocations"):
        column = "id" if table == "jobs" else "job_id"
        assert query(db_url, f"SELECT COUNT(*) FROM {table} WHERE {column} = :j", j=old) == [(0,)], table
    assert not (env.root / old).exists() and not list((env.root / ".trash").iterdir())
    assert env.client.get(f"/v1/jobs/{old}", headers=auth(env.owner)).status_code == 404
    assert env.recorded(db_url, continued) == ["step_000001"] and env.on_disk(continued) == ["step_000001"]  # a live job continues it
    assert env.client.get(f"/v1/jobs/{waiting}", headers=auth(env.owner)).json()["state"] == "queued"  # not ended: never touched
    assert env.client.post(f"/v1/jobs/{waiting}/cancel", headers=auth(env.owner)).status_code == 200
    assert retention.sweep_jobs(env.client.app)["jobs"] == 1  # nobody continues it any more; the one just ended stays
    assert {r[0] for r in query(db_url, "SELECT id FROM jobs")} == {waiting} and not (env.root / continued).exists()


def test_idempotency_records_expire_after_their_ttl_and_the_key_then_runs_again(make_client: Any, keys: Any, tmp_path: Path,
                                                                              db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, idempotency_ttl_s=DAY)
    body, headers = {"kind": "train", "config": {"model": "tiny"}}, {**auth(env.owner), "Idempotency-Key": "nightly-1"}
    first = env.client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == 201, first.text
    env.clock.advance(DAY - 1.0)
    assert retention.sweep_jobs(env.client.app)["keys"] == 0
    replayed = env.client.post("/v1/jobs", json=body, headers=headers)
    assert replayed.headers.get("Idempotent-Replayed") == "true" and replayed.json()["id"] == first.json()["id"]
    env.clock.advance(2.0)
    assert retention.sweep_jobs(env.client.app)["keys"] == 1
    assert query(db_url, "SELECT COUNT(*) FROM idempotency") == [(0,)]
    again = env.client.post("/v1/jobs", json=body, headers=headers)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers and again.json()["id"] != first.json()["id"]


def test_the_background_sweeper_deletes_ended_jobs_past_the_tenants_keep(make_client: Any, keys: Any, tmp_path: Path, db_url: str) -> None:
    env = Env(make_client, keys, tmp_path, background=True, sweep_interval_s=0.05, lease_ttl_s=1e9)
    job_id, epoch = env.run()
    env.checkpoint(job_id, epoch, 1)
    env.end(job_id, epoch)
    kept = CliRunner().invoke(main, ["scheduler", "tenants", "set", "acme", "--keep-ended-jobs", "0", "--db", db_url])
    assert kept.exit_code == 0 and "keep_ended_jobs=0" in kept.stdout, kept.output
    env.clock.advance(61.0)  # the next pass is due
    deadline = time.monotonic() + 20.0
    while (query(db_url, "SELECT id FROM jobs WHERE id = :j", j=job_id) or (env.root / job_id).exists()) and time.monotonic() < deadline:
        time.sleep(0.05)  # no request: the app's background task does it
    assert query(db_url, "SELECT id FROM jobs WHERE id = :j", j=job_id) == [] and not (env.root / job_id).exists()
