"""End to end on 127.0.0.1: a scheduler, real `tinkergym worker` processes, and `tinkergym train --scheduler` from a
client process in which torch cannot be imported. The first worker is killed with SIGKILL after the job's
first checkpoint; a second worker takes the job at the next epoch; the run finishes with the metrics of a
local run with the same seed, step for step (that GRPO raises the reward of a local run is
tests/trainers/test_learning.py's to show: its warmed-up tiny model is a folder, which a job cannot name).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner
from sqlalchemy import func, select

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import allocations, checkpoints, jobs, make_engine
from tinkergym.trainers.reporting import read_metrics

pytestmark = pytest.mark.slow

VOLATILE = ("time/", "tokens/per_s")
RUN = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "6", "--batch-size", "4", "--group-size", "4",
       "--max-new-tokens", "6", "--lr", "3e-2", "--checkpoint-every", "1", "--quiet")
# As in an install without torch: importing it fails (transformers then sees none); prints what got loaded.
CLIENT = """
import json, sys
sys.modules["torch"] = None
from tinkergym.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"torch_modules": sorted(m for m in sys.modules if m.startswith("torch.") or m == "torch" and sys.modules[m] is not None)}))
"""


def _worker(url: str, key: str, name: str, work_dir: Path, cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache)}
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", url, "--slots", "1", "--models", "tiny", "--name", name,
               "--work-dir", str(work_dir), "--heartbeat", "0.5", "--poll", "0.2", *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work_dir.parent / f"{name}.log", "w"), env=env)


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_torch_free_client_trains_through_workers_and_survives_one(db_url: str, keys: Any, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    local = tmp_path / "local"
    result = CliRunner().invoke(main, ["train", *RUN, "--out", str(local)], catch_exceptions=False)
    assert result.exit_code == 0, result.output

    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)))
    (tmp_path / "w1").mkdir()
    (tmp_path / "w2").mkdir()
    first = _worker(scheduler.url, worker_key, "w1", tmp_path / "w1" / "work", cache)
    second = None
    out = tmp_path / "scheduled"
    client = subprocess.Popen([sys.executable, "-c", CLIENT, "train", *RUN, "--out", str(out), "--scheduler", scheduler.url],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TINKERGYM_API_KEY": client_key, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
    try:
        deadline = time.monotonic() + 300
        while not any((tmp_path / "w1" / "work").rglob("states/step_000001/state.json")):  # the job's first checkpoint, on w1
            assert client.poll() is None, client.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint on the first worker"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = _worker(scheduler.url, worker_key, "w2", tmp_path / "w2" / "work", cache)
        stdout, stderr = client.communicate(timeout=600)
    finally:
        for process in (first, second, client):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
    assert client.returncode == 0, stderr[-4000:]
    assert json.loads(stdout.strip().splitlines()[-1]) == {"torch_modules": []}
    assert "waiting for the job's next lease" in stderr
    redo = re.search(r"job \S+: reconnected to its new server \(epoch 2\); redoing step (\d+) from (checkpoint step_(\d{6})|the start)", stderr)
    assert redo, stderr[-4000:]
    assert int(redo.group(1)) == (int(redo.group(3)) + 1 if redo.group(3) else 0)

    records = read_metrics(out / "metrics.jsonl")
    assert _stable(records) == _stable(read_metrics(local / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(6))
    assert (out / "final" / "adapter_model.safetensors").is_file()
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            job = conn.execute(select(jobs)).mappings().one()
            held = conn.execute(select(func.count()).select_from(allocations)).scalar_one()
    finally:
        engine.dispose()
    assert job["state"] == "succeeded" and job["lease_epoch"] == 2 and job["attempt"] == 1 and held == 0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_dead_client_frees_its_job_and_resume_goes_on_from_its_checkpoints(db_url: str, keys: Any, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    local = tmp_path / "local"
    assert CliRunner().invoke(main, ["train", *RUN, "--out", str(local)], catch_exceptions=False).exit_code == 0

    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2)))
    (tmp_path / "w1").mkdir()
    worker = _worker(scheduler.url, worker_key, "w1", tmp_path / "w1" / "work", cache, "--idle-timeout", "10")
    out = tmp_path / "scheduled"
    engine = make_engine(db_url)
    try:
        client = subprocess.Popen([sys.executable, "-m", "tinkergym", "train", *RUN, "--out", str(out), "--scheduler", scheduler.url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "TINKERGYM_API_KEY": client_key, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step_000001").is_dir():  # the run's first checkpoint: the client dies
            assert client.poll() is None, client.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint recorded"
            time.sleep(0.05)
        client.send_signal(signal.SIGKILL)
        client.wait()
        first_job = json.loads((out / "config.json").read_text())["scheduler_job"]
        while True:  # its server idles out, the worker ends the job: the device is free
            with engine.connect() as conn:
                job = conn.execute(select(jobs).where(jobs.c.id == first_job)).mappings().one()
                held = conn.execute(select(func.count()).select_from(allocations)).scalar_one()
            if job["state"] == "failed":
                break
            assert time.monotonic() < deadline, f"the job stayed {job['state']}"
            time.sleep(0.1)
        assert held == 0 and "--resume" in job["error"]
        with engine.connect() as conn:  # what its worker saved to the artifact store before the server stopped
            assert conn.execute(select(func.count()).select_from(checkpoints)).scalar_one() >= 1

        monkeypatch.setenv("TINKERGYM_API_KEY", client_key)
        resumed = CliRunner().invoke(main, ["train", "--resume", str(out), "--quiet"], catch_exceptions=False)
        assert resumed.exit_code == 0, resumed.output
    finally:
        worker.kill()
        worker.wait()
        scheduler.stop()
    second_job = json.loads((out / "config.json").read_text())["scheduler_job"]
    with engine.connect() as conn:
        second = conn.execute(select(jobs).where(jobs.c.id == second_job)).mappings().one()
    engine.dispose()
    assert second_job != first_job and second["state"] == "succeeded" and json.loads(second["config"])["resume_job"] == first_job
    assert _stable(read_metrics(out / "metrics.jsonl")) == _stable(read_metrics(local / "metrics.jsonl"))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the scheduler's part is the same on both: the leases' tests cover PostgreSQL
def test_a_two_device_job_runs_its_server_on_two_ranks_and_trains_as_one_device(db_url: str, keys: Any, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --gpus 2` on a worker with 2 slots: its server runs under torchrun, one rank per slot (the model sharded),
    its checkpoints are sharded states, and its first step is the local one-device run's (float32: within 1e-5)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    run = (*RUN[: RUN.index("--steps") + 1], "3", *RUN[RUN.index("--steps") + 2:])
    local = tmp_path / "local"
    assert CliRunner().invoke(main, ["train", *run, "--out", str(local)], catch_exceptions=False).exit_code == 0
    client_key, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=10.0, sweep_interval_s=0.2)))
    (tmp_path / "w1").mkdir()
    worker = _worker(scheduler.url, worker_key, "w1", tmp_path / "w1" / "work", cache, "--slots", "2")
    out = tmp_path / "scheduled"
    try:
        done = subprocess.run([sys.executable, "-m", "tinkergym", "train", *run, "--out", str(out), "--scheduler", scheduler.url, "--gpus", "2"],
                              capture_output=True, text=True, timeout=600, check=False,
                              env={**os.environ, "TINKERGYM_API_KEY": client_key, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
    finally:
        worker.kill()
        worker.wait()
        scheduler.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    states = sorted(p for p in (tmp_path / "data").rglob("state.json") if ".sha256" not in p.parts)  # uploaded: 2 ranks
    assert len(states) == 3 and all(json.loads(p.read_text())["ranks"] == 2 and (p.parent / "dcp").is_dir() for p in states), states
    assert not (tmp_path / "w1" / "work" / "jobs").exists() or not any((tmp_path / "w1" / "work" / "jobs").iterdir())  # nothing left
    mine, theirs = read_metrics(out / "metrics.jsonl"), read_metrics(local / "metrics.jsonl")
    assert [r["step"] for r in mine] == [0, 1, 2]
    # The first step samples from the same starting weights, so it is the same step: every number within float32's reach.
    # (Later steps sample from weights that differ by the order of float sums, 1e-7 to 1e-5 after Adam, and a sampled
    # token may flip; tests/backends/test_sharded.py shows the sharded step equals one process's on the same batch.)
    first, alone = _stable(mine)[0], _stable(theirs)[0]
    assert first.keys() == alone.keys()
    for key in first:
        assert first[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-5), key
    assert (out / "final" / "adapter_model.safetensors").is_file() and (out / "final" / "adapter_config.json").is_file()
