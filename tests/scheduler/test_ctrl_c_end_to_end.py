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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner
from sqlalchemy import func, select

from workerkit import WorkerProcess, serve_scheduler  # registered by conftest.py

from tinkergym.cli import main
from tinkergym.scheduler.db import allocations, jobs, make_engine
from tinkergym.plumbing.folders import latest_checkpoint

pytestmark = pytest.mark.slow

TIMEOUT_S = 300  # a bound on failure only
# Far more steps than any phase runs: a checkpoint reaches the run folder once the worker stored it, which can lag
# the steps on a busy machine, and no phase may finish the run before its Ctrl-C.
RUN = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "5000", "--batch-size", "2", "--group-size", "4",
       "--max-new-tokens", "4", "--checkpoint-every", "1", "--quiet")


@dataclass
class Cluster:
    """A scheduler on 127.0.0.1 with one worker: its URL, a client key, an engine on its database; ``client(*args)``
    starts ``tinkergym *args`` under the key (its stderr piped), killed at the end of the test if it still runs."""

    url: str
    key: str
    engine: Any
    cache: Path
    clients: list[subprocess.Popen] = field(default_factory=list)

    def client(self, *args: str) -> subprocess.Popen:
        env = {**os.environ, "TINKERGYM_API_KEY": self.key, "TINKERGYM_CACHE": str(self.cache)}
        self.clients.append(subprocess.Popen([sys.executable, "-m", "tinkergym", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                             text=True, env=env))
        return self.clients[-1]


@pytest.fixture
def cluster(db_url: str, keys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = serve_scheduler(db_url, tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)
    worker = WorkerProcess(scheduler.url, worker_key, tmp_path / "w1", "w1", heartbeat="0.5")
    running = Cluster(scheduler.url, client_key, make_engine(db_url), tmp_path / "client-cache")
    try:
        yield running
    finally:
        for process in running.clients:
            if process.poll() is None:
                process.kill()
            process.wait()
        worker.stop()
        scheduler.stop()
        running.engine.dispose()


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


def _wait_cancelled(engine: Any, job_id: str) -> None:
    """Until the job is cancelled and its devices freed."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        job, held = _job(engine, job_id)
        if job["state"] == "cancelled" and held == 0:
            return
        assert time.monotonic() < deadline, f"the job stayed {job['state']} holding {held} device(s)"
        time.sleep(0.1)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_ctrl_c_leaves_or_cancels_the_job_and_the_run_goes_on(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    # --keep-on-interrupt: the client exits, the job runs on and says how to reattach.
    client = cluster.client("train", *RUN, "--out", str(out), "--scheduler", cluster.url, "--keep-on-interrupt")
    stderr = _interrupt_after(client, out / "checkpoints" / "step_000001")
    assert client.returncode == 130, stderr[-3000:]
    job_id = json.loads((out / "config.json").read_text())["scheduler_job"]
    assert f"job {job_id} keeps running" in stderr and f"reattach with: tinkergym train --resume {out}" in stderr
    assert "Aborted!" not in stderr
    job, held = _job(cluster.engine, job_id)
    assert job["state"] == "running" and held == 1

    # A resume reattaches to it; Ctrl-C now cancels it, and its device is freed.
    reached = latest_checkpoint(out)[0] + 2
    client = cluster.client("train", "--resume", str(out), "--quiet")
    stderr = _interrupt_after(client, out / "checkpoints" / f"step_{reached:06d}")
    assert client.returncode == 130, stderr[-3000:]
    assert f"job {job_id} is cancelled" in stderr and f"go on with: tinkergym train --resume {out}" in stderr
    assert json.loads((out / "config.json").read_text())["scheduler_job"] == job_id
    _wait_cancelled(cluster.engine, job_id)

    # The run folder is whole: a resume goes on from its newest checkpoint in a new job.
    last = latest_checkpoint(out)[0]
    monkeypatch.setenv("TINKERGYM_API_KEY", cluster.key)
    resumed = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", str(last + 2), "--quiet"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    config = json.loads((out / "config.json").read_text())
    second, held = _job(cluster.engine, config["scheduler_job"])
    assert config["scheduler_job"] != job_id and json.loads(second["config"])["resume_job"] == job_id
    assert second["state"] == "succeeded" and held == 0
    assert latest_checkpoint(out)[0] == last + 1 and (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_ctrl_c_cancels_a_running_eval_job(cluster: Cluster) -> None:
    client = cluster.client("eval", "--env", "tinker/Bandit-v0", "--model", "tiny", "--episodes", "100000", "--max-new-tokens", "4",
                            "--scheduler", cluster.url)
    seen = ""
    while "evaluating tiny at" not in seen:  # the eval job's server answers: the evaluation runs
        line = client.stderr.readline()
        assert line, f"the client ended: {seen[-3000:]}"
        seen += line
    client.send_signal(signal.SIGINT)
    stderr = seen + client.communicate(timeout=TIMEOUT_S)[1]
    assert client.returncode == 130, stderr[-3000:]
    with cluster.engine.connect() as conn:
        job_id = conn.execute(select(jobs.c.id).where(jobs.c.kind == "eval")).scalar_one()
    assert f"job {job_id} is cancelled" in stderr and "Aborted!" not in stderr
    _wait_cancelled(cluster.engine, job_id)
