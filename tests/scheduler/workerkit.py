"""Helpers for the worker and lease tests: a clock the test moves, and a worker and a client on a TestClient."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import testkit
from sqlalchemy import text

from tinkergym.scheduler.db import make_engine
from tinkergym.scheduler.repository import JobStore


class Clock:
    """A fake time source: ``clock()`` is ``t``; tests move it with ``advance``."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def smollm2_config() -> Any:
    """SmolLM2-135M's architecture (no weights: the shape is counted on the meta device)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def smollm2_shape() -> dict[str, Any]:
    """SmolLM2-135M's shape as a worker registers it (``model_shapes``)."""
    from tinkergym.backends.torch.sizing import model_shape, shape_dict

    return shape_dict(model_shape(smollm2_config()))


@dataclass
class Worker:
    """A registered worker: its id, key and the client it talks through."""

    client: Any
    key: str
    id: str
    body: dict[str, Any] = field(default_factory=dict)

    def post(self, path: str, json: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self.client.post(f"/v1/workers/{self.id}{path}", json=json, headers={**auth(self.key), **(headers or {})})

    def lease(self) -> dict[str, Any] | None:
        response = self.post("/lease")
        assert response.status_code == 200, response.text
        return response.json()["lease"]

    def heartbeat(self, job_id: str, epoch: int) -> Any:
        return self.post(f"/jobs/{job_id}/heartbeat", {"epoch": epoch})

    def state(self, job_id: str, epoch: int, state: str, **extra: Any) -> Any:
        return self.post(f"/jobs/{job_id}/state", {"epoch": epoch, "state": state, **extra})


def register(client: Any, key: str, name: str = "w1", devices: int = 2, models: tuple[str, ...] = ("tiny",),
             host: str = "127.0.0.1", kind: str = "slot") -> Worker:
    """Register a worker with ``devices`` devices (indexes 0..n-1) serving ``models``."""
    body = {"name": name, "host": host, "devices": [{"index": i, "kind": kind, "name": f"dev{i}"} for i in range(devices)],
            "models": list(models)}
    response = client.post("/v1/workers", json=body, headers=auth(key))
    assert response.status_code == 200, response.text
    return Worker(client, key, response.json()["id"], body)


def submit(client: Any, key: str, gpus: int = 1, priority: int = 0, model: str = "tiny", **extra: Any) -> str:
    """Queue a job; its id."""
    body = {"kind": "train", "config": {"model": model}, "gpus": gpus, "priority": priority, **extra}
    response = client.post("/v1/jobs", json=body, headers=auth(key))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def query(db_url: str, sql: str, **params: Any) -> list[Any]:
    """Rows of ``sql`` read on a connection of its own (not through the app)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def job_row(db_url: str, job_id: str) -> dict[str, Any]:
    cols = ("state", "attempt", "lease_epoch", "worker_id", "lease_expires_at", "server_url", "server_token_digest", "error")
    (row,) = query(db_url, f"SELECT {', '.join(cols)} FROM jobs WHERE id = :id", id=job_id)
    return dict(zip(cols, row))


def allocated(db_url: str, job_id: str | None = None) -> list[tuple[Any, ...]]:
    """(device_id, job_id) of every allocation (or one job's)."""
    if job_id is None:
        return query(db_url, "SELECT device_id, job_id FROM allocations ORDER BY device_id")
    return query(db_url, "SELECT device_id, job_id FROM allocations WHERE job_id = :j ORDER BY device_id", j=job_id)


def assert_no_double_grant(db_url: str) -> None:
    """No device in two allocations, and every job holding a lease holds exactly its number of devices (a league: a seat
    a player)."""
    from tinkergym.scheduler.seats import players

    assert query(db_url, "SELECT device_id FROM allocations GROUP BY device_id HAVING COUNT(*) > 1") == []
    rows = query(db_url, "SELECT j.id, j.gpus, j.state, j.config, COUNT(a.device_id) FROM jobs j LEFT JOIN allocations a ON a.job_id = j.id "
                         "GROUP BY j.id, j.gpus, j.state, j.config")
    for job_id, gpus, state, config, held in rows:
        expected = max(gpus, players(config)) if state in ("leased", "starting", "running", "cancelling") else 0
        assert held == expected, (job_id, state, gpus, held)


def serve_scheduler(db_url: str, data_dir: Path, **settings: Any) -> Any:
    """A scheduler app on ``db_url`` (its sweeper on) served by uvicorn on 127.0.0.1: a ``ThreadServer``; ``stop()`` it."""
    from tinkergym.serve.asgi import ThreadServer
    from tinkergym.scheduler.app import SchedulerSettings, create_app

    return ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=data_dir, **settings)))


class WorkerProcess:
    """``tinkergym worker --slots 1 --models tiny`` as a subprocess (``extra`` arguments after its own), its log in
    ``<folder>/worker.log``."""

    def __init__(self, scheduler: str, key: str, folder: Path, name: str, *extra: str, heartbeat: str = "0.4", poll: str = "0.2",
                 ports: str = "21000-29999") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", scheduler, "--slots", "1", "--models", "tiny",
                   "--name", name, "--work-dir", str(folder / "work"), "--heartbeat", heartbeat, "--poll", poll, "--port-range", ports,
                   *extra]
        self.log = open(folder / "worker.log", "wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "TINKERGYM_API_KEY": key})

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.folder / "work" / "jobs" / job_id / str(epoch)

    def text(self) -> str:
        return (self.folder / "worker.log").read_text(errors="replace")

    def stop(self) -> None:
        testkit.stop(self.process, timeout=30)
        self.log.close()


def stored_job(db_url: str, config: dict[str, Any], tenant: str = "acme") -> str:
    """A queued train job stored as is, past the submission's checks (what a scheduler before typed job configs kept):
    its worker must still refuse a config it cannot start with."""
    engine = make_engine(db_url)
    try:
        store = JobStore(engine)
        with store.transaction() as conn:
            job, _ = store.create_queued_job(conn, tenant_id=tenant, kind="train", gpus=1, config=config, count_queue=False)
        return job["id"]
    finally:
        engine.dispose()


def multi_device_job(app: Any, gpus: int, tenant: str = "acme", priority: int = 0, model: str = "tiny", max_attempts: int | None = None) -> str:
    """A queued train job on ``gpus`` devices, stored through the app's own store (its clock) past the submission's checks.

    Stored past the submission's checks (a kind's device count, ``tinkergym.scheduler.schemas.USABLE_DEVICES``, and
    the tenant's quota): the leases grant such jobs all their devices or none, backfill around them and count them
    against quotas, and their tests make them here.
    """
    store = app.state.store
    with store.transaction() as conn:
        job, _ = store.create_queued_job(conn, tenant_id=tenant, kind="train", gpus=gpus, config={"model": model}, priority=priority,
                                         max_attempts=max_attempts or app.state.settings.max_attempts, count_queue=False)
    return job["id"]


def shared_worker(url: str, key: str, folder: Path, cache: Path, seats: int = 3, model: str = "tiny", env: dict[str, str] | None = None) -> Any:
    """``tinkergym worker`` as a process: one CPU slot whose device 0 is shared (``seats`` seats of ``model`` in float32,
    ranks up to 16), a fast heartbeat and poll, ``env`` added to its environment; its log in ``folder/worker.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", url, "--slots", "1", "--models", model, "--name", folder.name,
               "--shared-devices", "0", "--seats", str(seats), "--shared-dtype", "float32", "--max-lora-rank", "16",
               "--work-dir", str(folder / "work"), "--heartbeat", "0.5", "--poll", "0.2"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(folder / "worker.log", "w"),
                            env={**os.environ, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache), **(env or {})})


class Deadlock(Exception):
    """What psycopg raises when PostgreSQL breaks a deadlock by rolling this transaction back (or, with another
    ``sqlstate``, another error of the database)."""

    def __init__(self, message: str, sqlstate: str = "40P01") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def deadlocked_once(function: Any, statement: str, sqlstate: str = "40P01") -> tuple[Any, list[int]]:
    """``function`` raising, at its first call only, the ``OperationalError`` of a transaction PostgreSQL rolled back to
    break a deadlock in ``statement`` (another ``sqlstate``: another error); and the list its calls are counted in."""
    from sqlalchemy.exc import OperationalError

    runs: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        if len(runs) == 1:
            raise OperationalError(statement, {}, Deadlock("deadlock detected", sqlstate))
        return function(*args, **kwargs)

    return flaky, runs
