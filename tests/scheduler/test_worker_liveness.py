"""Silent workers: listed ``gone`` after the worker timeout (the background sweeper notices with no other traffic),
never granted anything, ``alive`` again at their next call, forgotten after a long silence when they hold nothing;
``tinkergym scheduler workers list`` shows the status. A worker that stops cleanly says so and is ``gone`` at once."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
from click.testing import CliRunner
from tinkergym.scheduler import leases
from workerkit import (  # registered by conftest.py
    Clock,
    WorkerProcess,
    allocated,
    auth,
    job_row,
    query,
    register,
    submit,
)

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app


def listing(client: Any, admin: str, **params: Any) -> dict[str, dict[str, Any]]:
    response = client.get("/v1/workers", params=params, headers=auth(admin))
    assert response.status_code == 200, response.text
    return {w["id"]: w for w in response.json()["workers"]}


@pytest.fixture
def env(make_client: Any, keys: Any) -> Any:
    """A client on a fake clock (lease TTL 30 s, worker timeout 90 s, forget after a day) and user, worker, admin keys."""
    clock = Clock()

    class Env:
        client = make_client(clock=clock, lease_ttl_s=30.0, worker_timeout_s=90.0, worker_forget_s=86400.0)
        user = keys.new("acme", "read,write")
        worker = keys.new("ops", "worker")
        admin = keys.new("ops", "admin")

    Env.clock = clock
    return Env()


def test_timeout_defaults_to_three_ttls_and_is_never_below_one(make_client: Any) -> None:
    settings = make_client(lease_ttl_s=20.0).app.state.settings
    assert leases.worker_timeout(settings) == 60.0
    settings.worker_timeout_s = 5.0
    assert leases.worker_timeout(settings) == 20.0  # a worker heartbeating its leases is never gone


def test_a_silent_worker_is_gone_gets_nothing_and_comes_back_when_it_polls(env: Any, db_url: str) -> None:
    silent = register(env.client, env.worker, name="silent", devices=2)
    busy = register(env.client, env.worker, name="busy", devices=1)
    assert {w["status"] for w in listing(env.client, env.admin).values()} == {"alive"}
    env.clock.advance(60.0)
    assert busy.lease() is None  # busy calls, silent does not
    env.clock.advance(31.0)  # silent: 91 s without a call
    shown = listing(env.client, env.admin)
    assert shown[silent.id]["status"] == "gone" and shown[busy.id]["status"] == "alive"
    assert list(listing(env.client, env.admin, status="gone")) == [silent.id]
    assert leases.sweep_workers(env.client.app) == {"gone": 1, "forgotten": 0}
    # Work queued now goes to the live worker only; the gone worker's devices stay free.
    job_id = submit(env.client, env.user, gpus=1)
    assert busy.lease()["job_id"] == job_id
    second = submit(env.client, env.user, gpus=1)
    silent_devices = [r[0] for r in query(db_url, "SELECT id FROM devices WHERE worker_id = :w", w=silent.id)]
    assert all(device not in silent_devices for device, _ in allocated(db_url))
    assert job_row(db_url, second)["state"] == "queued"
    # Its next poll brings it back (and it may take work again).
    lease = silent.lease()
    assert lease is not None and lease["job_id"] == second
    assert listing(env.client, env.admin)[silent.id]["status"] == "alive"
    assert leases.sweep_workers(env.client.app) == {"gone": 0, "forgotten": 0}


def test_heartbeats_keep_a_busy_worker_alive_and_registering_brings_one_back(env: Any) -> None:
    w = register(env.client, env.worker, devices=1)
    submit(env.client, env.user)
    lease = w.lease()
    for _ in range(10):  # 200 s with only heartbeats: its devices are all busy, so it does not poll
        env.clock.advance(20.0)
        assert w.heartbeat(lease["job_id"], lease["epoch"]).status_code == 200
    assert listing(env.client, env.admin)[w.id]["status"] == "alive"
    other = register(env.client, env.worker, name="other", devices=1)
    env.clock.advance(1000.0)
    assert listing(env.client, env.admin)[other.id]["status"] == "gone"
    again = env.client.post("/v1/workers", json=other.body, headers=auth(env.worker))
    assert again.status_code == 200 and again.json()["id"] == other.id and again.json()["status"] == "alive"


@pytest.mark.slow
def test_the_background_sweeper_marks_a_silent_worker_gone_with_no_other_traffic(make_client: Any, keys: Any, db_url: str) -> None:
    client = make_client(background=True, lease_ttl_s=0.5, sweep_interval_s=0.05, worker_timeout_s=1.0)
    user, worker_key, admin = keys.new("acme", "read,write"), keys.new("ops", "worker"), keys.new("ops", "admin")
    w = register(client, worker_key, devices=1)
    job_id = submit(client, user)
    assert w.lease()["job_id"] == job_id  # then the worker dies: no heartbeat, no poll
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and w.id not in getattr(client.app.state, "gone_workers", set()):
        time.sleep(0.05)  # no request: only the app's background task can notice
    assert w.id in client.app.state.gone_workers
    assert job_row(db_url, job_id)["state"] == "queued" and allocated(db_url) == []  # its lease expired, its device is free
    shown = listing(client, admin)[w.id]
    assert shown["status"] == "gone" and shown["devices"][0]["busy"] is False
    assert w.lease()["job_id"] == job_id  # back, and the job with it
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and w.id in client.app.state.gone_workers:
        w.heartbeat(job_id, 2)
        time.sleep(0.05)
    assert w.id not in client.app.state.gone_workers


def test_a_worker_gone_a_day_is_forgotten_only_when_it_holds_nothing(env: Any, db_url: str) -> None:
    w = register(env.client, env.worker, devices=1)
    idle = register(env.client, env.worker, name="idle", devices=1)
    ended = submit(env.client, env.user)
    lease = w.lease()
    assert w.state(ended, lease["epoch"], "starting").status_code == 200
    assert w.state(ended, lease["epoch"], "failed", error="x").status_code == 200
    held = submit(env.client, env.user)
    lease = w.lease()
    assert lease["job_id"] == held
    env.clock.advance(86401.0)
    # Its lease ended long ago but was not swept yet: it still holds the job, so it is kept.
    assert not leases.forget_worker(env.client.app.state.store, w.id, env.clock() - 86400.0)
    assert leases.sweep_workers(env.client.app) == {"gone": 1, "forgotten": 1}  # idle went; w holds a job
    assert [r[0] for r in query(db_url, "SELECT id FROM workers")] == [w.id]
    assert leases.sweep(env.client.app) == 1  # the lease expires: the job is queued again, the device freed
    assert leases.sweep_workers(env.client.app) == {"gone": 0, "forgotten": 1}
    assert query(db_url, "SELECT id FROM workers") == [] and query(db_url, "SELECT id FROM devices") == []
    assert query(db_url, "SELECT worker_id FROM jobs WHERE id = :j", j=ended) == [(None,)]
    # A forgotten worker's next poll is 404; it registers again (as tinkergym worker does) and works on.
    assert w.post("/lease").status_code == 404
    back = register(env.client, env.worker, devices=1)
    assert back.lease()["job_id"] == held
    assert idle.post("/lease").status_code == 404


def test_forgetting_is_off_with_zero(make_client: Any, keys: Any) -> None:
    clock = Clock()
    client = make_client(clock=clock, worker_forget_s=0)
    register(client, keys.new("ops", "worker"))
    clock.advance(10 * 86400.0)
    assert leases.sweep_workers(client.app) == {"gone": 1, "forgotten": 0}


def test_cli_workers_list_shows_the_status(env: Any, db_url: str, tmp_path: Any) -> None:
    env.clock.t = time.time() - 3600.0  # the CLI reads the wall clock: this worker was last seen an hour ago
    stale = register(env.client, env.worker, name="stale", devices=1)
    env.clock.t = time.time()
    register(env.client, env.worker, name="fresh", devices=2)
    args = ["scheduler", "workers", "list", "--db", db_url, "--data-dir", str(tmp_path / "cli")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line.split() for line in result.stdout.splitlines()[1:]}
    assert lines["fresh"][3] == "alive" and lines["fresh"][4] == "0/2"
    assert lines["stale"][3] == "gone" and stale.id in result.stdout
    gone_only = CliRunner().invoke(main, [*args, "--gone"])
    assert gone_only.exit_code == 0 and "stale" in gone_only.stdout and "fresh" not in gone_only.stdout
    assert "stale" not in CliRunner().invoke(main, [*args, "--gone", "--worker-timeout", "7200"]).stdout  # seen within 2 h


def test_a_worker_that_leaves_is_gone_at_once_and_alive_at_its_next_call(env: Any) -> None:
    w = register(env.client, env.worker, name="leaving", devices=1)
    other = env.client.post(f"/v1/workers/{w.id}/leave", headers=auth(env.user))
    assert other.status_code == 403  # a tenant's key is no worker
    left = w.post("/leave")
    assert left.status_code == 200 and left.json()["status"] == "gone"
    assert listing(env.client, env.admin)[w.id]["status"] == "gone"  # at once, not after the 90 s timeout
    assert w.lease() is None  # its next call: alive again
    assert listing(env.client, env.admin)[w.id]["status"] == "alive"


@pytest.mark.slow
def test_a_worker_stopped_with_sigterm_is_listed_gone_at_once(db_url: str, keys: Any, tmp_path: Any) -> None:
    admin = keys.new("acme", "admin")
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", worker_timeout_s=3600.0,
                                                       lease_ttl_s=30.0)))
    worker = WorkerProcess(server.url, keys.new("ops", "worker"), tmp_path / "w1", "w1")
    try:
        def statuses() -> list[str]:
            request = urllib.request.Request(server.url + "/v1/workers", headers=auth(admin))
            with urllib.request.urlopen(request, timeout=10) as response:
                return [w["status"] for w in json.loads(response.read())["workers"]]

        deadline = time.monotonic() + 120
        while statuses() != ["alive"]:
            assert worker.process.poll() is None and time.monotonic() < deadline, worker.text()[-2000:]
            time.sleep(0.1)
        worker.stop()  # SIGTERM: a clean stop
        assert worker.process.returncode == 0
        assert statuses() == ["gone"]  # with a worker timeout of an hour: it said it left
    finally:
        worker.stop()
        server.stop()
