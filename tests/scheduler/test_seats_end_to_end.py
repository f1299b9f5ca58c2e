"""Three LoRA jobs of two tenants packed onto one worker's shared training server, with real processes on 127.0.0.1:
a scheduler, `tinkergym worker --shared-devices 0 --seats 3`, and three `tinkergym train --scheduler` clients (ranks
4, 8 and 16). While they run, each job's token reaches its own adapter alone on the one server; then the worker is
killed with SIGKILL (its shared server dies with it), a second worker with whole devices only takes the three jobs at
the next epoch and each resumes from its own seat's checkpoint on a server of its own; that worker is killed too, and a
third, with seats only, takes them back onto a shared server from the whole servers' checkpoints. Every run ends with
the metrics of the same run trained locally (a `TorchBackend` in the client's process), step for step (float32:
counts equal, losses and norms to 1e-4): one job, one result, wherever it ran and however often it moved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from click.testing import CliRunner
from sqlalchemy import select

from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import allocations, checkpoints, devices, jobs, make_engine
from tinkergym.serve.asgi import ThreadServer
from workerkit import WorkerProcess, shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py
from tinkergym.trainers.reporting import read_metrics

pytestmark = pytest.mark.slow

VOLATILE = ("time/", "tokens/per_s")
TRAINING = ("--env", "tinker/Bandit-v0", "--steps", "12", "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "3e-2",
            "--checkpoint-every", "1", "--quiet")
RANKS = (4, 8, 16)


def _stable(records: list[dict]) -> list[dict]:
    """The metrics that do not depend on time, floats rounded to what equal gradients (to 1e-5) keep equal."""
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _run_args(k: int) -> list[str]:
    return [*TRAINING, "--model", "tiny", "--dtype", "float32", "--lora-rank", str(RANKS[k]), "--seed", str(k)]


def _solo_runs(tmp_path: Path) -> None:
    """Each run alone and local: a TorchBackend in this process, no server."""
    for k in range(3):
        result = CliRunner().invoke(main, ["train", *_run_args(k), "--out", str(tmp_path / f"solo{k}")], catch_exceptions=False)
        assert result.exit_code == 0, result.output


def _wait_for_checkpoints(engine: Any, clients: list[Any], epoch: int, seats: bool) -> list[Any]:
    """Until every job runs at ``epoch`` on a seat (``seats``) or a whole device, each with a checkpoint of that epoch;
    the jobs' allocations."""
    deadline = time.monotonic() + 600
    while True:
        with engine.connect() as conn:
            placed = conn.execute(select(allocations.c.job_id, devices.c.seat_of, devices.c.worker_id)
                                  .join(devices, devices.c.id == allocations.c.device_id)).all()
            saved = {r.job_id for r in conn.execute(select(checkpoints.c.job_id).where(checkpoints.c.epoch == epoch))}
            running = {r.id for r in conn.execute(select(jobs.c.id).where(jobs.c.state == "running", jobs.c.lease_epoch == epoch))}
        if len(placed) == 3 and {p.job_id for p in placed} <= saved & running:
            assert all((p.seat_of is not None) == seats for p in placed), placed
            return placed
        for client in clients:
            assert client.poll() is None, client.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the jobs did not all run and checkpoint at epoch {epoch}: {placed}, {saved}, {running}"
        time.sleep(0.1)


def _measured(engine: Any, seats: bool) -> list[Any]:
    """The held seats' (``seats``) or whole devices' rows once each has a measure from its server's heartbeat."""
    deadline = time.monotonic() + 60
    while True:
        with engine.connect() as conn:
            rows = conn.execute(select(devices.c.used_bytes, devices.c.peak_bytes, devices.c.host_bytes, devices.c.base_bytes)
                                .join(allocations, allocations.c.device_id == devices.c.id)
                                .where(devices.c.seat_of.is_not(None) if seats else devices.c.seat_of.is_(None))).all()
        if rows and all(r.used_bytes is not None for r in rows):
            return rows
        assert time.monotonic() < deadline, f"no measure reached the devices: {rows}"
        time.sleep(0.2)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_killed_worker_with_three_packed_jobs_of_two_tenants(db_url: str, keys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    _solo_runs(tmp_path)

    tenant_keys = [keys.new("acme", "read,write"), keys.new("acme", "read,write"), keys.new("beta", "read,write")]
    worker_key = keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2)))
    first = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache)
    second: WorkerProcess | None = None
    third = None
    clients = []
    engine = make_engine(db_url)
    try:
        for k in range(3):  # each env step waits 1 s (it changes no number), so no run ends before all three are seated
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "tinkergym", "train", *_run_args(k), "--env-latency", "1", "--out", str(tmp_path / f"run{k}"),
                 "--scheduler", scheduler.url],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "TINKERGYM_API_KEY": tenant_keys[k], "TINKERGYM_CACHE": str(tmp_path / f"client-cache{k}")}))
        seated = _wait_for_checkpoints(engine, clients, epoch=1, seats=True)  # every job on a seat of w1's one shared server
        assert all(s.seat_of == 0 for s in seated) and len({s.worker_id for s in seated}) == 1
        job_ids = [json.loads((tmp_path / f"run{k}" / "config.json").read_text())["scheduler_job"] for k in range(3)]

        # each job's token reaches its own adapter alone, on the one shared server
        connections = []
        for k, job_id in enumerate(job_ids):
            answer = httpx.get(f"{scheduler.url}/v1/jobs/{job_id}/connection", headers={"Authorization": f"Bearer {tenant_keys[k]}"})
            assert answer.status_code == 200, answer.text
            connections.append(answer.json())
        assert httpx.get(f"{scheduler.url}/v1/jobs/{job_ids[0]}/connection",
                         headers={"Authorization": f"Bearer {tenant_keys[2]}"}).status_code == 404, "another tenant's job is not found"
        assert len({c["url"] for c in connections}) == 1
        for k, connection in enumerate(connections):
            bearer = {"Authorization": f"Bearer {connection['token']}"}
            info = httpx.get(f"{connection['url']}/v1/info", headers=bearer).json()
            assert info["lora_rank"] == RANKS[k]
            assert httpx.get(f"{connection['url']}/v1/adapters", headers=bearer).status_code == 403, "a job's token opens no adapter"
            other = job_ids[(k + 1) % 3]
            # its own export once its run has reached the end (a fast client can, under load), else none: never another job's
            # (the three ranks differ)
            exported = httpx.get(f"{connection['url']}/v1/files/exports/final/adapter_config.json", headers=bearer)
            assert exported.status_code in (400, 404) or (exported.status_code == 200 and exported.json()["r"] == RANKS[k]), exported.text
            assert other not in httpx.get(f"{connection['url']}/v1/info", headers=bearer).text

        # the seats' heartbeats carry the shared server's measured memory: on every seat of its device, above the base's
        seat_measures = _measured(engine, seats=True)
        assert len(seat_measures) == 3 and len({(m.used_bytes, m.base_bytes) for m in seat_measures}) == 1, seat_measures
        assert all(0 < m.base_bytes <= m.used_bytes <= m.peak_bytes and m.host_bytes > 0 for m in seat_measures), seat_measures

        first.send_signal(signal.SIGKILL)
        first.wait()
        # seats to whole devices: a worker without seats takes the three jobs, each on a server of its own
        second = WorkerProcess(scheduler.url, worker_key, tmp_path / "w2", "w2", "--slots", "3", heartbeat="0.5")
        _wait_for_checkpoints(engine, clients, epoch=2, seats=False)
        whole_measures = _measured(engine, seats=False)  # each whole server's on its own device
        assert len(whole_measures) == 3 and all(m.used_bytes > 0 and m.base_bytes is None for m in whole_measures), whole_measures
        second.process.send_signal(signal.SIGKILL)
        second.process.wait()
        # and back: a worker with seats only takes them onto one shared server from the whole servers' checkpoints
        third = shared_worker(scheduler.url, worker_key, tmp_path / "w3", cache)
        errors = []
        for client in clients:
            _, stderr = client.communicate(timeout=600)
            assert client.returncode == 0, stderr[-4000:]
            errors.append(stderr)
    finally:
        for process in (first, second.process if second else None, third, *clients):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
    for stderr in errors:
        assert "reconnected to its new server (epoch 2)" in stderr and "reconnected to its new server (epoch 3)" in stderr, stderr[-3000:]
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.lease_epoch, jobs.c.attempt))}
        held = conn.execute(select(allocations)).all()
    engine.dispose()
    assert all((rows[j].state, rows[j].lease_epoch, rows[j].attempt) == ("succeeded", 3, 2) for j in job_ids), rows
    assert held == []
    for k in range(3):
        records = read_metrics(tmp_path / f"run{k}" / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(12))
        assert _stable(records) == _stable(read_metrics(tmp_path / f"solo{k}" / "metrics.jsonl")), f"run {k} differs from its solo run"
        saved = json.loads((tmp_path / f"run{k}" / "final" / "adapter_config.json").read_text())
        assert saved["r"] == RANKS[k]
