"""A job's server stops serving when its lease ends, even while its worker is frozen.

The worker writes the lease's deadline into the server's lease file and moves it on with every heartbeat the
scheduler accepts (:class:`tinkergym.serve.auth.LeaseFile`). A frozen (SIGSTOPped) worker renews nothing:
its server refuses its own token once the deadline passes (401 ``lease_ended``), while the scheduler expires the lease
and queues the job again. Thawed, the worker learns the lease is gone and stops the server.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from testkit import wait_until  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.serve.auth import LeaseFile, require_token, token_digest, write_lease_file
from tinkergym.client import SchedulerClient
from tinkergym.scheduler.app import SchedulerSettings, create_app

TOKEN = "t" * 40


def _get(url: str, token: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_a_server_refuses_every_call_once_its_lease_file_says_the_lease_ended(tmp_path: Path) -> None:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/info")
    def info() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    lease = tmp_path / "lease"
    require_token(app, token_digest(TOKEN), lease=LeaseFile(lease))
    server = ThreadServer(app)
    try:
        assert _get(server.url + "/v1/info", TOKEN)[0] == 401  # no lease file yet: closed
        write_lease_file(lease, time.monotonic() + 60, 1)
        assert _get(server.url + "/v1/info", TOKEN) == (200, {"ok": "yes"})
        assert _get(server.url + "/v1/info", "x" * 40)[1]["error"]["type"] == "unauthorized"
        write_lease_file(lease, time.monotonic() - 1, 1)  # the deadline passed
        status, body = _get(server.url + "/v1/info", TOKEN)
        assert status == 401 and body["error"]["type"] == "lease_ended"
        write_lease_file(lease, time.monotonic() + 60, 1)  # renewed
        assert _get(server.url + "/v1/info", TOKEN)[0] == 200
        lease.write_text("not json")
        assert _get(server.url + "/v1/info", TOKEN)[0] == 401
        assert _get(server.url + "/health", "")[0] == 200  # public as ever
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_frozen_workers_server_refuses_its_old_token_after_the_lease_ends(db_url: str, keys: Any, tmp_path: Path) -> None:
    owner_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)))
    work = tmp_path / "work"
    env = {**os.environ, "TINKERGYM_API_KEY": worker_key, "TINKERGYM_CACHE": str(tmp_path / "cache")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tinkergym", "worker", "--scheduler", scheduler.url, "--slots", "1", "--models", "tiny", "--name", "w1",
         "--work-dir", str(work), "--heartbeat", "0.5", "--poll", "0.2"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w"), env=env)
    owner = SchedulerClient(scheduler.url, owner_key)
    try:
        job_id = owner.submit("train", {"model": "tiny", "dtype": "float32", "lora_rank": 4})["id"]
        wait_until("the job's server", lambda: owner.show(job_id)["state"] == "running", 300)
        connection = owner.connection(job_id)
        url, token = connection["url"].rstrip("/"), connection["token"]
        assert _get(url + "/v1/info", token)[0] == 200

        worker.send_signal(signal.SIGSTOP)  # frozen: no heartbeat, no kill of its server
        refused = wait_until("the server to refuse", lambda: (answer := _get(url + "/v1/info", token))[0] == 401 and answer, 30)
        assert refused[1]["error"]["type"] == "lease_ended"
        assert _get(url + "/health", "")[0] == 200  # the process still runs: only its lease ended
        wait_until("the lease to expire", lambda: owner.show(job_id)["state"] == "queued", 30)

        worker.send_signal(signal.SIGCONT)  # thawed: its next heartbeat is refused and it stops the server

        def gone() -> bool:
            try:
                _get(url + "/health", "")
            except (OSError, http.client.HTTPException):  # refused, or cut mid-answer
                return True
            return False

        wait_until("the old server to stop", gone, 60)
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        owner.close()
        scheduler.stop()
