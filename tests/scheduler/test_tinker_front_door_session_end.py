"""A Tinker SDK client killed without ``close()`` (a script that dies, or ends without closing) through the front door
(`serve tinker --scheduler`): once its session has had no heartbeat for the session timeout, its run's and sampler's jobs
end, with the reason in the job's record (`tinkergym jobs show`), their seats free, and the state it saved loads from a
new client. Another tenant's heartbeats for the session keep nothing alive, and its finish ends nothing. A front door
stopped for good after its client died leaves the jobs to the scheduler's idle timeout, which ends seats' jobs too."""

from __future__ import annotations

import json
import logging
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
tinker = pytest.importorskip("tinker")

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from workerkit import allocated, shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

#: Three of the SDK's heartbeat periods (10 s), the least `serve tinker --session-timeout` takes.
SESSION_TIMEOUT = 30.0
MAINTENANCE = 1.0
#: The scheduler's idle timeout where the front door is stopped for good (its client is gone before it: no call comes).
IDLE_TIMEOUT = 15.0

#: The client: a LoRA run trained one step, a state saved, a sampler of its weights; it prints what it holds, then waits.
CLIENT = """
import json, sys, time
import tinker
from tinker import types

rows = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44]]
datums = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
          for r in rows]
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
training.forward_backward(datums, "cross_entropy").result()
training.optim_step(types.AdamParams(learning_rate=3e-2)).result()
state = training.save_state("kept").result().path
sampler = training.save_weights_and_get_sampling_client().result()
sampler.sample(types.ModelInput.from_ints(rows[0][:4]), 1, types.SamplingParams(max_tokens=2)).result()
loss = training.forward(datums, "cross_entropy").result().metrics["loss:sum"]
print(json.dumps({"state": state, "loss": loss, "session": training.model_id.split(":")[0]}), flush=True)
time.sleep(3600)
"""


def _kill_when_ready(client: subprocess.Popen, log: Path) -> dict[str, Any]:
    """What the client printed once it held a run, a state and a sampler; it is then killed (SIGKILL: no close())."""
    line = client.stdout.readline()
    assert line, log.read_text()[-3000:]
    client.send_signal(signal.SIGKILL)
    client.wait()
    return json.loads(line)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_killed_clients_session_ends_its_jobs_with_the_reason_and_its_state_loads(db_url: str, keys: Any, tiny: str, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from tinkergym.backends.models import resolve_model
    from tinkergym.cli.jobs import jobs_group as jobs_command
    from tinkergym.client import SchedulerClient
    from tinkergym.scheduler.db import make_engine
    from tinkergym.tinker_api.server import create_front_door
    from tinker import types

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    tokenizer = resolve_model("tiny")
    alice, bob, worker_key = keys.new("acme", "read,write"), keys.new("other", "read,write"), keys.new("ops", "worker")
    engine = make_engine(db_url)
    # an idle timeout far past the session's: the session's end, not the scheduler's, must end the jobs
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2,
                                                          idle_timeout_s=600.0)))
    door = ThreadServer(create_front_door(scheduler.url, {"tiny": tokenizer}, tmp_path / "door", engine, logging.getLogger("session-end-test"),
                                          dtype="float32", session_timeout_s=SESSION_TIMEOUT, maintenance_s=MAINTENANCE))
    worker = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=2)  # the run and its sampler fill it
    client = subprocess.Popen([sys.executable, "-c", CLIENT, door.url, "tml-" + alice], stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "client.log", "w"), text=True)
    owner = SchedulerClient(scheduler.url, alice)
    try:
        held = _kill_when_ready(client, tmp_path / "client.log")
        killed = time.monotonic()
        job_ids = [j["id"] for j in owner.list()]
        assert len(job_ids) == 2 and all(owner.show(j)["state"] == "running" for j in job_ids)  # the run's and the sampler's

        def post(who: str, path: str) -> int:
            return httpx.post(f"{door.url}{path}", headers={"X-API-Key": "tml-" + who}, json={"session_id": held["session"]}, timeout=30).status_code

        while any(owner.show(j)["state"] == "running" for j in job_ids):
            # another tenant can neither keep the session alive nor end it
            assert post(bob, "/api/v1/session_heartbeat") == 410 and post(bob, f"/api/v1/sessions/{held['session']}/finish") == 404
            assert time.monotonic() - killed < SESSION_TIMEOUT + 30, "the dead client's jobs still run"
            time.sleep(1.0)
        ended = time.monotonic() - killed
        assert allocated(db_url) == []  # both seats free
        why = f"its Tinker session ended: no heartbeat from the client for {SESSION_TIMEOUT:g} s"
        for job_id in job_ids:
            job = owner.show(job_id)
            assert job["state"] == "succeeded" and job["end_reason"].startswith(why), job
            shown = CliRunner().invoke(jobs_command, ["show", job_id, "--scheduler", scheduler.url, "--api-key", alice])
            assert shown.exit_code == 0 and f"end_reason:     {why}" in shown.output, shown.output
        assert post(alice, "/api/v1/session_heartbeat") == 410  # the SDK stops its heartbeats at a 410: the session has ended

        # a new client resumes from the state the killed one saved, on a seat the ended jobs freed
        with tinker.ServiceClient(base_url=door.url, api_key="tml-" + alice) as service:
            resumed = service.create_training_client_from_state(held["state"]).result()
            rows = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44]]
            datums = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                      for r in rows]
            loss = resumed.forward(datums, "cross_entropy").result().metrics["loss:sum"]
    finally:
        for process in (client, worker):
            if process.poll() is None:
                process.kill()
                process.wait()
        door.stop()
        scheduler.stop()
        engine.dispose()
    assert loss == pytest.approx(held["loss"], rel=1e-4)  # the saved weights
    assert ended < SESSION_TIMEOUT + MAINTENANCE + 10, ended  # within the timeout (less the time since its last heartbeat) and a pass


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_jobs_of_a_front_door_stopped_for_good_end_at_the_idle_timeout(db_url: str, keys: Any, tiny: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The front door (a process) killed after its client: nobody ends its seats' jobs, and the scheduler's idle timeout does, with
    the reason."""
    import testkit

    from tinkergym.backends.models import resolve_model
    from tinkergym.client import SchedulerClient

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    tokenizer = resolve_model("tiny")
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2,
                                                          idle_timeout_s=IDLE_TIMEOUT)))
    worker = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=2)
    port = testkit.free_port()
    door = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve", "tinker", "--scheduler", scheduler.url, "--offer", f"tiny={tokenizer}",
                             "--dtype", "float32", "--db", db_url, "--run-dir", str(tmp_path / "door"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "door.log", "w"), env={**os.environ, "TINKERGYM_CACHE": str(cache)})
    client = None
    try:
        testkit.wait_until_answers(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=120, process=door)
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", "tml-" + alice], stdout=subprocess.PIPE,
                                  stderr=open(tmp_path / "client.log", "w"), text=True)
        _kill_when_ready(client, tmp_path / "client.log")
        door.send_signal(signal.SIGKILL)
        door.wait()
        stopped = time.monotonic()
        owner = SchedulerClient(scheduler.url, alice)
        job_ids = [j["id"] for j in owner.list()]
        assert len(job_ids) == 2
        while any(owner.show(j)["state"] == "running" for j in job_ids):
            assert time.monotonic() - stopped < IDLE_TIMEOUT + 30, "the stopped front door's jobs still run"
            time.sleep(1.0)
        assert allocated(db_url) == []  # both seats free
        for job_id in job_ids:
            job = owner.show(job_id)
            assert job["state"] == "failed" and "Tinker front door (serve tinker --scheduler) sent no call for the idle timeout" in job["error"], job
    finally:
        for process in (client, door, worker):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
