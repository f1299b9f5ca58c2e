"""A scheduler killed with SIGKILL in the middle of a burst of submissions and lease grants, then restarted.

Every submission a client saw acknowledged is in the database; none is there twice (the clients retry what
was cut off with the same Idempotency-Key); every device is held by at most one job, and only by a job that
holds a lease (checked in the database, on SQLite and PostgreSQL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tinkergym.client import SchedulerClient, SchedulerError
from tinkergym.scheduler import states
from tinkergym.scheduler.auth import ensure_tenant
from tinkergym.scheduler.db import allocations, idempotency, jobs, make_engine
from tinkergym.scheduler.repository import JobStore

#: Submitting clients and the jobs each submits; jobs on two devices stored up front (the API refuses those today).
CLIENTS, PER_CLIENT, WIDE = 6, 20, 4


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(db_url: str, data_dir: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tinkergym", "scheduler", "serve", "--db", db_url, "--data-dir", str(data_dir), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the scheduler exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the scheduler did not start")


@pytest.mark.slow
def test_sigkill_during_a_burst_loses_and_duplicates_nothing(db_url: str, keys: Any, tmp_path: Path) -> None:
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    engine = make_engine(db_url)
    with engine.begin() as conn:
        ensure_tenant(conn, "acme", max_queued=CLIENTS * PER_CLIENT + WIDE)
    store = JobStore(engine)
    with store.transaction() as conn:  # the worker below takes all their devices or none
        wide = {store.create_queued_job(conn, tenant_id="acme", kind="train", gpus=2, config={"model": "tiny"}, count_queue=False)[0]["id"]
                for _ in range(WIDE)}
    engine.dispose()
    port, data_dir = _port(), tmp_path / "data"
    url = f"http://127.0.0.1:{port}"
    scheduler = _serve(db_url, data_dir, port)
    acknowledged: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def submit_many(n: int) -> None:
        client = SchedulerClient(url, client_key, retries=12, backoff=0.25, timeout=10)
        try:
            for i in range(PER_CLIENT):
                job = client.submit("train", {"model": "tiny", "env": "tinker/Bandit-v0", "seed": n * 1000 + i}, gpus=1)
                with lock:
                    acknowledged.append(job["id"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            client.close()

    def lease_many(stop: threading.Event) -> None:
        # A worker with 3 slots asking for work all along, so grants are in flight when the scheduler dies.
        worker = SchedulerClient(url, worker_key, retries=12, backoff=0.25, timeout=10)
        try:
            body = {"name": "w1", "host": "127.0.0.1", "devices": [{"index": i, "kind": "slot"} for i in range(3)], "models": ["tiny"]}
            worker_id = worker._request("POST", "/v1/workers", body)["id"]
            while not stop.is_set():
                try:
                    worker._request("POST", f"/v1/workers/{worker_id}/lease", {})
                except SchedulerError:
                    pass
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            worker.close()

    stop = threading.Event()
    threads = [threading.Thread(target=submit_many, args=(n,)) for n in range(CLIENTS)]
    leaser = threading.Thread(target=lease_many, args=(stop,))
    for thread in [*threads, leaser]:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(acknowledged) < CLIENTS * PER_CLIENT // 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(scheduler.pid, signal.SIGKILL)  # mid-burst: requests in flight are cut
        scheduler.wait()
        at_kill = len(acknowledged)
        time.sleep(0.5)
        scheduler = _serve(db_url, data_dir, port)
        for thread in threads:
            thread.join(timeout=120)
        stop.set()
        leaser.join(timeout=30)
    finally:
        stop.set()
        scheduler.terminate()
        scheduler.wait(15)
    assert not errors, errors
    assert 0 < at_kill < CLIENTS * PER_CLIENT  # the kill really fell inside the burst

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            in_db = conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.gpus)).all()
            keyed = conn.execute(select(func.count()).select_from(idempotency).where(idempotency.c.path == "/v1/jobs")).scalar_one()
            held = conn.execute(select(allocations.c.device_id, allocations.c.job_id)).all()
    finally:
        engine.dispose()
    ids = [row.id for row in in_db]
    assert len(acknowledged) == len(set(acknowledged)) == CLIENTS * PER_CLIENT
    assert set(acknowledged) == set(ids) - wide  # every acknowledged job is there, and no other (no duplicate from a retry)
    assert keyed == len(ids) - WIDE
    holding = {row.id: row.gpus for row in in_db if row.state in states.HOLDING}
    assert len({device for device, _ in held}) == len(held)  # never a device twice
    assert all(job in holding for _, job in held)  # only jobs that hold a lease hold devices
    per_job: dict[str, int] = {}
    for _, job in held:
        per_job[job] = per_job.get(job, 0) + 1
    assert per_job == holding  # all of a job's devices or none
    assert holding, "the worker took no job: the grants were not exercised"
