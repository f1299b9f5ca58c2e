"""Ctrl-C in ``tinkergym train --scheduler`` on 127.0.0.1, with a real worker: the first one cancels the job (or, with
--keep-on-interrupt, leaves it running for a --resume to reattach to); the run folder goes on from its checkpoints in a new job.
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

import pytest

pytest.importorskip("torch")
pytest.importorskip("uvicorn")

from click.testing import CliRunner  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from tinkergym.backends.asgi import ThreadServer  # noqa: E402
from tinkergym.cli import main  # noqa: E402
from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import allocations, jobs, make_engine  # noqa: E402
from tinkergym.trainers.session import latest_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 300  # a bound on failure only
RUN = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "200", "--batch-size", "2", "--group-size", "4",
       "--max-new-tokens", "4", "--checkpoint-every", "1", "--quiet")


def _worker(url: str, key: str, work_dir: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache)}
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", url, "--slots", "1", "--models", "tiny", "--name", "w1",
               "--work-dir", str(work_dir), "--heartbeat", "0.5", "--poll", "0.2"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work_dir.parent / "w1.log", "w"), env=env)


def _interrupt_after(client: subprocess.Popen, checkpoint: Path) -> str:
    """Send SIGINT once ``checkpoint`` is written (the job runs); the client's stderr once it has exited."""
    deadline = time.monotonic() + TIMEOUT_S
    while not checkpoint.is_dir():
        assert client.poll() is None, client.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {checkpoint.name}"
        time.sleep(0.05)
    client.send_signal(signal.SIGINT)
    return client.communicate(timeout=TIMEOUT_S)[1]


def _job(engine: Any, job_id: str) -> tuple[dict[str, Any], int]:
    with engine.connect() as conn:
        job = dict(conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().one())
        held = conn.execute(select(func.count()).select_from(allocations)).scalar_one()
    return job, held


def test_ctrl_c_leaves_or_cancels_the_job_and_the_run_goes_on(db_url: str, keys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)))
    (tmp_path / "w1").mkdir()
    worker = _worker(scheduler.url, worker_key, tmp_path / "w1" / "work", cache)
    out = tmp_path / "run"
    env = {**os.environ, "TINKERGYM_API_KEY": client_key, "TINKERGYM_CACHE": str(tmp_path / "client-cache")}
    engine = make_engine(db_url)
    clients: list[subprocess.Popen] = []
    try:
        # --keep-on-interrupt: the client exits, the job runs on and says how to reattach.
        clients.append(subprocess.Popen([sys.executable, "-m", "tinkergym", "train", *RUN, "--out", str(out), "--scheduler", scheduler.url,
                                         "--keep-on-interrupt"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
        stderr = _interrupt_after(clients[-1], out / "checkpoints" / "step_000001")
        assert clients[-1].returncode == 130, stderr[-3000:]
        job_id = json.loads((out / "config.json").read_text())["scheduler_job"]
        assert f"job {job_id} keeps running" in stderr and f"reattach with: tinkergym train --resume {out}" in stderr
        assert "Aborted!" not in stderr
        job, held = _job(engine, job_id)
        assert job["state"] == "running" and held == 1

        # A resume reattaches to it; Ctrl-C now cancels it, and its device is freed.
        reached = latest_checkpoint(out)[0] + 2
        clients.append(subprocess.Popen([sys.executable, "-m", "tinkergym", "train", "--resume", str(out), "--quiet"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
        stderr = _interrupt_after(clients[-1], out / "checkpoints" / f"step_{reached:06d}")
        assert clients[-1].returncode == 130, stderr[-3000:]
        assert f"job {job_id} is cancelled" in stderr and f"go on with: tinkergym train --resume {out}" in stderr
        assert json.loads((out / "config.json").read_text())["scheduler_job"] == job_id
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            job, held = _job(engine, job_id)
            if job["state"] == "cancelled" and held == 0:
                break
            assert time.monotonic() < deadline, f"the job stayed {job['state']} holding {held} device(s)"
            time.sleep(0.1)

        # The run folder is whole: a resume goes on from its newest checkpoint in a new job.
        last = latest_checkpoint(out)[0]
        monkeypatch.setenv("TINKERGYM_API_KEY", client_key)
        resumed = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", str(last + 2), "--quiet"], catch_exceptions=False)
        assert resumed.exit_code == 0, resumed.output
    finally:
        for process in (*clients, worker):
            if process.poll() is None:
                process.kill()
            process.wait()
        scheduler.stop()
    config = json.loads((out / "config.json").read_text())
    second, held = _job(engine, config["scheduler_job"])
    engine.dispose()
    assert config["scheduler_job"] != job_id and json.loads(second["config"])["resume_job"] == job_id
    assert second["state"] == "succeeded" and held == 0
    assert latest_checkpoint(out)[0] == last + 1 and (out / "final" / "adapter_model.safetensors").is_file()


def test_ctrl_c_cancels_a_running_eval_job(db_url: str, keys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)))
    (tmp_path / "w1").mkdir()
    worker = _worker(scheduler.url, worker_key, tmp_path / "w1" / "work", cache)
    env = {**os.environ, "TINKERGYM_API_KEY": client_key, "TINKERGYM_CACHE": str(tmp_path / "client-cache")}
    engine = make_engine(db_url)
    client = subprocess.Popen([sys.executable, "-m", "tinkergym", "eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--episodes", "100000",
                               "--max-new-tokens", "4", "--scheduler", scheduler.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = ""
        while "evaluating tiny at" not in seen:  # the eval job's server answers: the evaluation runs
            line = client.stderr.readline()
            assert line, f"the client ended: {seen[-3000:]}"
            seen += line
        client.send_signal(signal.SIGINT)
        stderr = seen + client.communicate(timeout=TIMEOUT_S)[1]
        assert client.returncode == 130, stderr[-3000:]
        with engine.connect() as conn:
            job_id = conn.execute(select(jobs.c.id).where(jobs.c.kind == "eval")).scalar_one()
        assert f"job {job_id} is cancelled" in stderr and "Aborted!" not in stderr
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            job, held = _job(engine, job_id)
            if job["state"] == "cancelled" and held == 0:
                break
            assert time.monotonic() < deadline, f"the job stayed {job['state']} holding {held} device(s)"
            time.sleep(0.1)
    finally:
        for process in (client, worker):
            if process.poll() is None:
                process.kill()
            process.wait()
        scheduler.stop()
        engine.dispose()
