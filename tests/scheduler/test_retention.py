"""Artifact retention, with the app's clock moved: an ended job keeps only its newest checkpoint after
``checkpoint_keep_s`` and nothing after ``artifact_retention_s`` (its row stays, an event says why); a job that a
live job continues keeps its newest; a job that has not ended is never touched, its uploads in progress included;
the app's background sweeper runs it; ``tinkergym scheduler serve`` takes the settings."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
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
    for option in ("--checkpoint-keep", "--artifact-retention", "--retention-interval", "--worker-timeout", "--forget-workers-after"):
        assert option in result.output
    bad = CliRunner().invoke(main, ["scheduler", "serve", "--lease-ttl", "30", "--worker-timeout", "10", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--worker-timeout" in bad.output
