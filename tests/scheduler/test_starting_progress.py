"""A job whose server is being prepared says what its worker is doing: the client's wait says each message the worker
logs between the lease and the server's start (restoring a checkpoint, loading the model), once, and none of the job's
earlier ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from workerkit import register  # registered by conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.client import SchedulerClient, wait_running
from tinkergym.scheduler.app import SchedulerSettings, create_app


def test_the_wait_says_what_the_worker_is_doing(make_client: Any, keys: Any, db_url: str, tmp_path: Path) -> None:
    worker_side = make_client()
    worker = register(worker_side, keys.worker(1), devices=1)
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    owner = SchedulerClient(server.url, keys.new("acme", "read,write"))
    try:
        job_id = owner.submit("train", {"model": "tiny"})["id"]
        owner.report(job_id, "log", {"message": "an earlier message of the job's own"})
        epoch = worker.lease()["epoch"]
        said: list[str] = []

        def log(message: str) -> None:
            assert worker.post(f"/jobs/{job_id}/events", {"epoch": epoch, "type": "log", "data": {"message": message}}).status_code == 200

        def say(message: str) -> None:  # the worker goes on as the client sees each step
            said.append(message)
            if message == f"job {job_id}: leased":
                log("restored checkpoint step_000004")
            elif message.endswith("restored checkpoint step_000004"):
                assert worker.state(job_id, epoch, "starting").status_code == 200
                log("starting its server on worker w1: loading tiny")
            elif message.endswith("loading tiny"):
                assert worker.state(job_id, epoch, "running", server_url="http://127.0.0.1:9").status_code == 200

        assert wait_running(owner, job_id, poll=0.02, say=say, timeout=60)["epoch"] == epoch
    finally:
        owner.close()
        server.stop()
    worker_lines = [m for m in said if m.startswith(f"job {job_id}: ") and ("restored" in m or "loading" in m or "earlier" in m)]
    assert worker_lines == [f"job {job_id}: restored checkpoint step_000004", f"job {job_id}: starting its server on worker w1: loading tiny"]
