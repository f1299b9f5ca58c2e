"""A killed Tinker front door (`serve tinker --scheduler`, a process) started again on its run folder: the official SDK's
objects made before the kill go on unchanged. Its session, two training runs (one with a state the scheduler holds and calls
since, one with none: its job is replaced and its calls replayed), a sampler and the checkpoints are kept; every loss after
the restart and the sampler's seeded draws equal the same session on a local serve tinker, and a request's result kept in
the journal is answered after the restart to its tenant alone."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")

from sqlalchemy import select  # noqa: E402

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import jobs, make_engine  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

ROWS = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44], list(range(100, 112))]


def _datums() -> list[Any]:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
            for r in ROWS]


def _step(training: Any) -> float:
    from tinker import types

    fwd = training.forward_backward(_datums(), "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return fwd.result().metrics["loss:sum"]


def _session(url: str, key: str, model: str, restart: Any) -> tuple[list[float], list[float], list[list[float]], dict[str, Any]]:
    """Run ``first`` 2 steps and ``second`` 1 step, a sampler of ``first``'s weights and a checkpoint of it saved by a plain
    request (its id and answer in ``seen``), ``first``'s third step, then ``restart(seen)``, then 2 more steps of each run and
    the sampler's seeded draws."""
    from tinker import types

    seen: dict[str, Any] = {}
    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        first = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
        second = service.create_lora_training_client(base_model=model, rank=4, seed=4).result()
        losses = [_step(first) for _ in range(2)]
        others = [_step(second)]
        sampler = first.save_weights_and_get_sampling_client().result()
        saved = httpx.post(f"{url}/api/v1/save_weights", headers={"X-API-Key": key}, json={"model_id": first.model_id, "path": "raw", "seq_id": 10**6})
        assert saved.status_code == 200, saved.text
        seen["request_id"], seen["model_id"] = saved.json()["request_id"], first.model_id
        done = httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": key}, json={"request_id": seen["request_id"]}, timeout=60)
        seen["answer"] = done.json()
        request = types.SampleRequest(sampling_session_id=sampler._sampling_session_id, prompt=types.ModelInput.from_ints(ROWS[1][:3]), num_samples=1,
                                      sampling_params=types.SamplingParams(max_tokens=3))
        drawn_once = httpx.post(f"{url}/api/v1/asample", headers={"X-API-Key": key}, json=request.model_dump(mode="json"))
        assert drawn_once.status_code == 200, drawn_once.text
        seen["sample_request_id"] = drawn_once.json()["request_id"]
        assert httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": key}, json={"request_id": seen["sample_request_id"]},
                          timeout=60).status_code == 200
        losses.append(_step(first))  # in the log since the state "raw": replayed on the job's server after the restart
        restart(seen)
        losses += [_step(first) for _ in range(2)]
        others += [_step(second) for _ in range(2)]
        drawn = sampler.sample(types.ModelInput.from_ints(ROWS[0][:4]), 2, types.SamplingParams(max_tokens=5, seed=7)).result()
        listed = tinker.RestClient(base_url=url, api_key=key).list_checkpoints(first.model_id).result().checkpoints
        seen["checkpoints"] = sorted(c.checkpoint_id for c in listed)
        return losses, others, [s.logprobs for s in drawn.sequences], seen


def _running_jobs(db_url: str) -> list[tuple[str, str]]:
    """(id, name) of the running jobs of training runs."""
    engine = make_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(select(jobs.c.id, jobs.c.name).where(jobs.c.state == "running")).all()
    engine.dispose()
    return [(r.id, r.name) for r in rows if ":train:" in r.name]


def _stray_calls(scheduler_url: str, key: str, job_id: str, calls: tuple[str, ...]) -> None:
    """``calls`` on the server of job ``job_id``, as the front door would make them, with other data than the session's."""
    from tinkergym.backends.remote import RemoteBackend
    from tinkergym.client import SchedulerClient, wait_running
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams

    connection = wait_running(SchedulerClient(scheduler_url, key), job_id, timeout=60, poll=0.2, say=lambda line: None)
    server = RemoteBackend(connection["url"], connection["token"])
    try:
        for call in calls:
            if call == "forward_backward":
                server.forward_backward(ForwardBackwardRequest([Datum(list(range(30, 50)), [1.0] * 20)], LossSpec("cross_entropy")))
            else:
                server.optim_step(OptimParams(learning_rate=0.5))
    finally:
        server.close()


def _front_door(scheduler: str, db_url: str, folder: Path, port: int, tokenizer: str, cache: Path) -> subprocess.Popen:
    import testkit

    log = open(folder.parent / f"door-{port}-{len(list(folder.parent.glob('door-*')))}.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve", "tinker", "--scheduler", scheduler, "--offer", f"tiny={tokenizer}",
                                "--checkpoint-every", "2", "--dtype", "float32", "--db", db_url, "--run-dir", str(folder), "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TINKERGYM_CACHE": str(cache)})
    testkit.wait_until_answers(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=120, process=process, output=testkit.log_text(Path(log.name)))
    return process


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_killed_front_door_started_again_keeps_its_clients_objects(db_url: str, keys: Any, tiny: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import testkit

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.tinker_api.server import create_server

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    tokenizer = resolve_model("tiny")
    alice, bob, worker_key = keys.new("acme", "read,write"), keys.new("other", "read,write"), keys.new("ops", "worker")
    engine = make_engine(db_url)

    base = SharedBase(SharedBaseConfig(model="tiny", dtype="float32", micro_batch_size=16, max_sessions=8))
    local = ThreadServer(create_server(base, tmp_path / "local", engine, logging.getLogger("restart-test"), model_name="tiny", tokenizer_id=tokenizer))
    try:
        expected = _session(local.url, "tml-" + alice, "tiny", lambda seen: None)
    finally:
        local.stop()

    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2,
                                                          idle_timeout_s=120.0)))
    port = testkit.free_port()
    url = f"http://127.0.0.1:{port}"
    processes = [shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=4)]
    processes.append(_front_door(scheduler.url, db_url, tmp_path / "door", port, tokenizer, cache))

    def restart(seen: dict[str, Any]) -> None:
        processes[1].send_signal(signal.SIGKILL)
        processes[1].wait()
        # calls that reached the runs' servers while the front door died, never logged: the restart must leave no trace of them
        # (the first run's server is brought back to its stored state and log, the second's job is replaced)
        running = {name.rsplit(":", 1)[1]: job_id for job_id, name in _running_jobs(db_url)}
        for which, calls in (("0", ("forward_backward",)), ("1", ("forward_backward", "optim_step"))):
            _stray_calls(scheduler.url, alice, running[which], calls)
        processes[1] = _front_door(scheduler.url, db_url, tmp_path / "door", port, tokenizer, cache)
        # a result kept in the journal: answered after the restart, to its tenant only
        headers = {"X-API-Key": "tml-" + alice}
        again = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json={"request_id": seen["request_id"]}, timeout=60)
        assert again.status_code == 200 and again.json() == seen["answer"], again.text
        theirs = httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": "tml-" + bob}, json={"request_id": seen["request_id"]}, timeout=60)
        assert theirs.status_code == 404
        # a sampler's result is not kept: after the restart it answers 410 (send it again), which the SDK turns into its retry
        lost = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json={"request_id": seen["sample_request_id"]}, timeout=60)
        assert lost.status_code == 410 and "send it again" in lost.text, lost.text
        unknown = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json={"request_id": "req-" + "0" * 24}, timeout=60)
        assert unknown.status_code == 404
        mine = httpx.get(f"{url}/api/v1/training_runs/{seen['model_id']}", headers=headers, timeout=60)
        assert mine.status_code == 200 and mine.json()["lora_rank"] == 4
        assert httpx.get(f"{url}/api/v1/training_runs/{seen['model_id']}", headers={"X-API-Key": "tml-" + bob}, timeout=60).status_code == 404
        # a heartbeat alone (no call yet) reattaches the session's two runs and its sampler and brings their servers back, so a
        # client that only sends heartbeats keeps its jobs; another tenant's heartbeat for the session is refused and moves nothing
        with sqlite3.connect(tmp_path / "door" / "front_door.sqlite") as journal:
            (session_id,) = journal.execute("select session_id from sessions").fetchone()
        assert httpx.post(f"{url}/api/v1/session_heartbeat", headers={"X-API-Key": "tml-" + bob}, json={"session_id": session_id},
                          timeout=60).status_code in (404, 410)
        beat = httpx.post(f"{url}/api/v1/session_heartbeat", headers=headers, json={"session_id": session_id}, timeout=60)
        assert beat.status_code == 200, beat.text
        log = max(tmp_path.glob("door-*.log"), key=lambda f: f.stat().st_mtime)
        deadline = time.monotonic() + 120
        while log.read_text().count("reattached after a restart") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert log.read_text().count("reattached after a restart") == 3, log.read_text()[-3000:]

    try:
        result = _session(url, "tml-" + alice, "tiny", restart)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        scheduler.stop()
    losses, others, drawn, seen = result
    np.testing.assert_allclose(losses, expected[0], rtol=1e-4)
    np.testing.assert_allclose(others, expected[1], rtol=1e-4)
    np.testing.assert_allclose(np.concatenate(drawn), np.concatenate(expected[2]), atol=1e-4)  # seeded: the same draws
    assert seen["checkpoints"] == expected[3]["checkpoints"] and "weights/raw" in seen["checkpoints"]
    assert seen["answer"]["path"].endswith("/weights/raw")
    with engine.connect() as conn:
        rows = conn.execute(select(jobs.c.name, jobs.c.state)).all()
    engine.dispose()
    second_jobs = [r for r in rows if r.name.endswith(":train:1")]
    assert len(second_jobs) == 2 and sorted(r.state for r in second_jobs)[0] == "cancelled", rows  # the run without a stored state: a new job
    assert len([r for r in rows if r.name.endswith(":train:0")]) == 1  # the run with one: the same job
