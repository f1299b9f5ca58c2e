"""``tinkergym worker`` end to end on 127.0.0.1 with CPU slots and the tiny model: a live scheduler, real worker
subprocesses, real training servers, the client's RemoteBackend talking to them directly.

One scenario per database, so the few servers it starts are shared by its steps: a job runs on worker 1 and saves
a state, which the worker uploads and records; worker 1 is killed with SIGKILL, its server stops (it dies with
its parent), the lease expires within TTL + sweep, the job is queued again and worker 2 takes it at epoch 2 with
the checkpoint restored (the old token is refused, the old epoch's writes are 409); the client completes the job
and the server stops; a second job is cancelled while running and its server is stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from click.testing import CliRunner

from testkit import free_port, wait_until  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.backends.remote import RemoteBackend, RemoteBackendError
from tinkergym.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    SampleRequest,
    SamplingParams,
)
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import make_engine

from tinkergym.cli import main
from tinkergym.client import SchedulerClient
from workerkit import WorkerProcess, stored_job  # registered by conftest.py

TTL, SWEEP = 2.0, 0.2
CONFIG = {"model": "tiny", "dtype": "float32", "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "micro_batch_size": 4, "seed": 0}


def in_state(client: SchedulerClient, job_id: str, state: str) -> dict[str, Any] | None:
    """The job when it is in ``state``, else None."""
    job = client.show(job_id)
    return job if job["state"] == state else None


def server_pids(run_dir: Path) -> list[int]:
    """Processes whose command line names ``run_dir`` (the job's server at one epoch)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                args = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as handle:
                zombie = handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if not zombie and b"serve" in args and args[args.index(b"serve") + 1] == b"backend" and str(run_dir).encode() in args:
            found.append(int(entry))
    return found


def refused(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1)
        conn.request("GET", "/health")
        conn.getresponse().read()
        conn.close()
    except OSError:
        return True
    return False


def status_with(url: str, token: str) -> int:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request("GET", "/v1/info", headers={"Authorization": f"Bearer {token}"})
    status = conn.getresponse().status
    conn.close()
    return status


def allocations(db_url: str) -> int:
    from sqlalchemy import text

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT COUNT(*) FROM allocations")).scalar_one())
    finally:
        engine.dispose()


def use(backend: RemoteBackend) -> None:
    """A sample and a gradient step through the server."""
    answer = backend.sample(SampleRequest(prompts=[[1, 2, 3]], params=SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)))
    assert len(answer.sequences[0]) == 1
    data = [Datum(tokens=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1], advantages=[0, 0, 1, 1, 1], sampling_logprobs=[0, 0, -1.0, -1.0, -1.0])]
    backend.forward_backward(ForwardBackwardRequest(data=data))


def test_worker_input_errors_exit_2(tmp_path: Path) -> None:
    for args in (["--slots", "1"], ["--scheduler", "http://127.0.0.1:1", "--key", "k"], ["--scheduler", "http://127.0.0.1:1", "--key", "k",
                 "--slots", "1", "--gpus", "0"], ["--scheduler", "http://127.0.0.1:1", "--key", "k", "--gpus", "0,0"],
                 ["--scheduler", "http://127.0.0.1:1", "--key", "k", "--slots", "1", "--models", "../x"],
                 ["--scheduler", "ftp://x", "--key", "k", "--slots", "1"], ["--scheduler", "http://127.0.0.1:1", "--key", "k", "--slots", "1",
                 "--port-range", "9-1"]):
        result = CliRunner().invoke(main, ["worker", "--work-dir", str(tmp_path / "w"), *args],
                                    env={"TINKERGYM_API_KEY": "", "TINKERGYM_SCHEDULER": ""})
        assert result.exit_code == 2, (args, result.output)
    assert not (tmp_path / "w").exists()


def test_a_metrics_port_in_use_exits_2_before_any_registration(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["worker", "--work-dir", str(tmp_path / "w"), "--scheduler", "http://127.0.0.1:1", "--key", "k",
                                           "--slots", "1", "--models", "tiny", "--skip-model-check", "--metrics-port", str(port)],
                                    env={"TINKERGYM_API_KEY": "", "TINKERGYM_SCHEDULER": ""})
    assert result.exit_code == 2, result.output
    assert f"--metrics-port {port}: cannot listen" in result.output and "pick a free port" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_worker_end_to_end(db_url: str, keys: Any, tmp_path: Path) -> None:
    settings = SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=TTL, sweep_interval_s=SWEEP)
    server = ThreadServer(create_app(settings))
    owner = SchedulerClient(server.url, keys.new("acme", "read,write"))
    worker_key = keys.new("acme", "worker")
    workers: list[WorkerProcess] = []
    try:
        # 1. A job runs on worker 1; the client reaches its server directly; a saved state becomes a checkpoint.
        first = WorkerProcess(server.url, worker_key, tmp_path / "w1", "w1")
        workers.append(first)
        job = owner.submit("train", CONFIG)["id"]
        wait_until("the job to run", lambda: owner.show(job)["state"] == "running", 180)
        conn = owner.connection(job)
        assert conn["epoch"] == 1
        backend = RemoteBackend(conn["url"], conn["token"], retries=1, backoff=0.1)
        use(backend)
        local = tmp_path / "client" / "step_000001"
        backend.save_state(str(local))
        found = wait_until("the checkpoint", lambda: owner.checkpoints(job), 60)
        assert [(c["step"], c["name"], c["epoch"]) for c in found] == [(1, "step_000001", 1)]
        listing = owner._request("GET", f"/v1/jobs/{job}/artifacts/step_000001")["files"]
        saved = first.run_dir(job, 1) / "states" / "step_000001"
        assert sorted(f["path"] for f in listing) == sorted(p.name for p in saved.iterdir())
        assert "state.json" in {f["path"] for f in listing}

        # 2. kill -9 worker 1: its server stops, the lease expires within TTL + sweep, the job is queued again.
        assert server_pids(first.run_dir(job, 1))
        first.process.kill()
        killed = time.monotonic()
        first.process.wait(10)
        wait_until("the orphaned server to stop", lambda: not server_pids(first.run_dir(job, 1)), 15)
        assert refused(conn["url"])
        shown = wait_until("the lease to expire", lambda: in_state(owner, job, "queued"), TTL + SWEEP + 5, 0.05)
        assert time.monotonic() - killed <= TTL + SWEEP + 1.5
        assert shown["attempt"] == 1 and allocations(db_url) == 0

        # 3. Worker 2 takes it at epoch 2 with the checkpoint restored; the old token and the old epoch are refused.
        metrics_port = free_port()
        second = WorkerProcess(server.url, worker_key, tmp_path / "w2", "w2", "--metrics-port", str(metrics_port))
        workers.append(second)
        wait_until("the job to run again", lambda: owner.show(job)["state"] == "running", 180)
        held = worker_metrics(metrics_port)
        assert held[("tinkergym_worker_places", (("kind", "device"), ("state", "held")))] == 1
        assert held[("tinkergym_worker_places", (("kind", "device"), ("state", "free")))] == 0
        assert held[("tinkergym_worker_lease_polls_total", (("result", "granted"),))] == 1
        conn2 = owner.connection(job)
        assert conn2["epoch"] == 2 and conn2["token"] != conn["token"]
        restored = second.run_dir(job, 2) / "states" / "step_000001"
        assert sorted(p.name for p in restored.iterdir()) == sorted(f["path"] for f in listing)
        backend2 = RemoteBackend(conn2["url"], conn2["token"], retries=1, backoff=0.1)
        backend2.load_state(str(local))
        use(backend2)
        assert status_with(conn2["url"], conn["token"]) == 401 and status_with(conn2["url"], conn2["token"]) == 200
        stale = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        worker_id = owner_worker_id(db_url, job)
        stale.request("POST", f"/v1/workers/{worker_id}/jobs/{job}/heartbeat", body=b'{"epoch": 1}',
                      headers={"Authorization": f"Bearer {worker_key}", "Content-Type": "application/json"})
        assert stale.getresponse().status == 409
        stale.close()

        # 4. The client completes the job: the worker stops the server and the device is free.
        assert owner.complete(job, 2)["state"] == "succeeded"
        wait_until("the completed job's server to stop", lambda: not server_pids(second.run_dir(job, 2)), 15)
        assert allocations(db_url) == 0
        with pytest.raises(RemoteBackendError):
            RemoteBackend(conn2["url"], conn2["token"], retries=0, timeout=2).info()

        # 5. A job the worker cannot start (a config it refuses, poison for its server) fails with the reason; the
        # worker lives on and runs the next one. Then a running job is cancelled: its server stops, the job ends cancelled.
        poison = stored_job(db_url, {**CONFIG, "lora_rank": "\u00e9" * 3, "dtype": "float32"})  # past the submission's checks
        failed = wait_until("the poison job to fail", lambda: in_state(owner, poison, "failed"), 60)
        assert "lora_rank" in failed["error"] and second.process.poll() is None
        other = owner.submit("train", CONFIG)["id"]
        wait_until("the second job to run", lambda: owner.show(other)["state"] == "running", 180)
        run_dir = second.run_dir(other, 1)
        assert server_pids(run_dir)
        owner.cancel(other)
        wait_until("the job to be cancelled", lambda: owner.show(other)["state"] == "cancelled", 30)
        assert not server_pids(run_dir) and allocations(db_url) == 0
        events = [e["data"].get("state") for e in owner.events(other) if e["type"] == "state"]
        assert events[-2:] == ["cancelling", "cancelled"]
        ended = wait_until("the worker's metrics of the three ends", lambda: (m := worker_metrics(metrics_port)).get(
            ("tinkergym_worker_jobs_ended_total", (("outcome", "cancelled"),))) and m, 10)
        for outcome in ("succeeded", "failed", "cancelled"):
            assert ended[("tinkergym_worker_jobs_ended_total", (("outcome", outcome),))] == 1, outcome
        assert ended[("tinkergym_worker_places", (("kind", "device"), ("state", "free")))] == 1
        assert ended[("tinkergym_worker_lease_polls_total", (("result", "granted"),))] == 3

        # 6. SIGTERM stops the worker cleanly.
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(30) == 0
    except BaseException:
        for worker in workers:
            sys.stderr.write(f"----- {worker.folder.name} -----\n{worker.text()[-6000:]}\n")
        raise
    finally:
        for worker in workers:
            worker.stop()
        owner.close()
        server.stop()


def worker_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The worker's ``--metrics-port`` listener, parsed with prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}


def owner_worker_id(db_url: str, job_id: str) -> str:
    from sqlalchemy import text

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SELECT worker_id FROM jobs WHERE id = :j"), {"j": job_id}).scalar_one())
    finally:
        engine.dispose()


def test_a_refused_key_exits_2(tmp_path: Path, db_url: str) -> None:
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    try:
        result = subprocess.run([sys.executable, "-m", "tinkergym", "worker", "--scheduler", server.url, "--slots", "1",
                                 "--work-dir", str(tmp_path / "w")], env={**os.environ, "TINKERGYM_API_KEY": "tgk_000000000000_" + "A" * 43},
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 2 and "401" in result.stderr, result.stderr
    finally:
        server.stop()


FAKE_SERVER = r'''
import http.server, json, os, sys, threading, time
args = sys.argv[sys.argv.index("serve") + 2:]  # after `serve backend`
opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
run, seed = opt["--run-dir"], int(opt["--seed"])
assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and opt["--device"] == "cpu" and oct(os.stat(opt["--token-file"]).st_mode & 0o777) == "0o600"

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass

server = http.server.ThreadingHTTPServer((opt["--host"], int(opt["--port"])), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
if seed in (75, 3):
    time.sleep(0.5)
    tmp = os.path.join(run, "states", "step_000002.tmp")
    os.makedirs(os.path.join(tmp, "sub"))
    open(os.path.join(tmp, "state.json"), "w").write(json.dumps({"step": 2}))
    open(os.path.join(tmp, "sub", "weights.bin"), "wb").write(os.urandom(3000))
    os.replace(tmp, os.path.join(run, "states", "step_000002"))
    time.sleep(1.5)
    print("boom: the fake server fails" if seed == 3 else "idle", flush=True)
    os._exit(seed)
time.sleep(3600)
'''


class CannedErrors:
    """ASGI wrapper of the scheduler: the next ``count`` requests that ``matches(path)`` are answered ``status`` with
    ``message`` instead (``answered`` counts them): the scheduler failing a while, or one answer a worker cannot use."""

    def __init__(self, app: Any, status: int, message: str, matches: Callable[[str], bool]) -> None:
        self.app, self.status, self.matches, self.count, self.answered = app, status, matches, 0, 0
        self.body = json.dumps({"error": {"type": "invalid_request" if status < 500 else "internal", "message": message}}).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.count > 0 and self.matches(scope.get("path", "")):
            self.count -= 1
            self.answered += 1
            await send({"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": self.body})
            return
        await self.app(scope, receive, send)


def fail_artifact_reads(app: Any) -> CannedErrors:
    """Workers' artifact reads answer 500 (the scheduler's database away), ``count`` times."""
    return CannedErrors(app, 500, "the database is away", lambda path: path.startswith("/v1/workers/") and "/artifacts" in path)


def refuse_leases(app: Any) -> CannedErrors:
    """Workers' lease requests answer 400 (one lease's answer a worker cannot use), ``count`` times."""
    return CannedErrors(app, 400, "this lease cannot be answered", lambda path: path.endswith("/lease"))


@contextlib.contextmanager
def fake_worker(wrap: Callable[[Any], Any], db_url: str, keys: Any, tmp_path: Path, poll: float = 0.1, devices: int = 1,
                before: Callable[[SchedulerClient], Any] | None = None) -> Iterator[tuple[Any, SchedulerClient, Any, Any]]:
    """A scheduler on 127.0.0.1 whose app ``wrap`` wraps, an owner's client, and a worker of ``devices`` slots in a thread
    whose servers are :data:`FAKE_SERVER`: ``(wrapped app, owner, worker, its thread)``, all stopped afterwards.
    ``before(owner)`` runs before the worker starts (jobs queued for its first lease request)."""
    import threading

    from tinkergym.scheduler.worker.pool import Worker, WorkerOptions
    from tinkergym.scheduler.worker.client import WorkerClient

    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    fake.chmod(0o755)
    app = wrap(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=TTL, sweep_interval_s=SWEEP)))
    server = ThreadServer(app)
    owner = SchedulerClient(server.url, keys.new("acme", "read,write"))
    options = WorkerOptions(name="fake", host="127.0.0.1", devices=[{"index": i, "kind": "slot", "name": f"s{i}"} for i in range(devices)],
                            models=["tiny"], work_dir=tmp_path / "work", ports=(30000, 39999), heartbeat=0.3, poll=poll, python=str(fake))
    worker = Worker(WorkerClient(server.url, keys.new("acme", "worker")), options)
    if before is not None:
        before(owner)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield app, owner, worker, thread
    finally:
        worker.stop()
        thread.join(30)
        owner.close()
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_server_exits_restores_and_uploads_with_a_fake_server(db_url: str, keys: Any, tmp_path: Path) -> None:
    """The worker's handling of its servers, with a stand-in for serve backend (no torch): a state it writes is uploaded and
    recorded; exit code 75 fails the job saying how to resume; another code fails it with the log's tail; a job that
    continues an ended one starts with that job's newest checkpoint restored."""
    with fake_worker(fail_artifact_reads, db_url, keys, tmp_path) as (flaky, owner, worker, _):
        idle = owner.submit("train", {**CONFIG, "seed": 75})["id"]
        ended = wait_until("the idle job to fail", lambda: in_state(owner, idle, "failed"), 60)
        assert "tinkergym train --resume" in ended["error"] and "exit code 75" in ended["error"]
        assert [(c["step"], c["name"]) for c in owner.checkpoints(idle)] == [(2, "step_000002")]
        files = owner._request("GET", f"/v1/jobs/{idle}/artifacts/step_000002")["files"]
        assert sorted(f["path"] for f in files) == ["state.json", "sub/weights.bin"]

        broken = owner.submit("train", {**CONFIG, "seed": 3})["id"]
        ended = wait_until("the broken job to fail", lambda: in_state(owner, broken, "failed"), 60)
        assert "exited with code 3" in ended["error"] and "boom: the fake server fails" in ended["error"]

        flaky.count = 3  # the restore meets a failing scheduler: the worker tries again while its lease holds
        continued = owner.submit("train", {**CONFIG, "resume_job": idle})["id"]
        wait_until("the continuing job to run", lambda: owner.show(continued)["state"] == "running", 60)
        assert flaky.answered == 3 and owner.show(continued)["lease_epoch"] == 1  # the same lease, not a new one
        restored = tmp_path / "work" / "jobs" / continued / "1" / "states" / "step_000002"
        stored = {f["path"]: f["sha256"] for f in files}  # the ended job's own folder is gone: compare with what was uploaded
        assert hashlib.sha256((restored / "sub" / "weights.bin").read_bytes()).hexdigest() == stored["sub/weights.bin"]
        time.sleep(1.0)  # the restored state is not uploaded again as the new job's
        assert owner.checkpoints(continued) == []
        owner.complete(continued, owner.show(continued)["lease_epoch"])
        wait_until("the device to be free", lambda: not worker.busy(), 15)
        assert allocations(db_url) == 0


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_worker_asks_for_the_next_lease_as_soon_as_a_job_frees_its_device(db_url: str, keys: Any, tmp_path: Path) -> None:
    """A job's end wakes the worker's lease loop: the next queued job starts at once, not at the next poll (60 s here)."""
    with fake_worker(lambda app: app, db_url, keys, tmp_path, poll=60.0) as (_, owner, worker, _thread):
        first, second = owner.submit("train", CONFIG)["id"], owner.submit("train", CONFIG)["id"]
        wait_until("the first job to run", lambda: owner.show(first)["state"] == "running", 60)
        assert owner.show(second)["state"] == "queued"
        owner.complete(first, owner.show(first)["lease_epoch"])
        started = time.monotonic()
        wait_until("the second job to be leased", lambda: owner.show(second)["state"] != "queued", 30)
        assert time.monotonic() - started < 20.0, "leased at the job's end, not at the 60 s poll"
        owner.complete(second, wait_until("the second job to run", lambda: in_state(owner, second, "running"), 60)["lease_epoch"])


class CountedCalls(CannedErrors):
    """ASGI wrapper of the scheduler counting the workers' calls by their last path part (``lease``, ``heartbeat``,
    ``heartbeats``, ...); ``count`` batched heartbeat calls are answered 404 first (a scheduler without that route)."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, 404, "Not Found", lambda path: path.endswith("/heartbeats"))
        self.calls: dict[str, int] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/v1/workers/"):
            self.calls[path.rsplit("/", 1)[-1]] = self.calls.get(path.rsplit("/", 1)[-1], 0) + 1
        await super().__call__(scope, receive, send)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
@pytest.mark.parametrize("batched", [True, False])
def test_a_worker_fills_its_slots_in_one_request_and_heartbeats_them_together(db_url: str, keys: Any, tmp_path: Path, batched: bool) -> None:
    """Three jobs queued for a worker of three slots: one lease request takes them all; their leases are renewed in one
    call a heartbeat interval (0.3 s here), not one call each. Against a scheduler without the batched route (404), each
    lease heartbeats on its own and every job runs all the same."""
    jobs: list[str] = []
    counted: list[CountedCalls] = []

    def wrap(app: Any) -> CountedCalls:
        counted.append(CountedCalls(app))
        counted[0].count = 0 if batched else 10**6
        return counted[0]

    def queue(owner: SchedulerClient) -> None:
        jobs.extend(owner.submit("train", {**CONFIG, "seed": 10 + i})["id"] for i in range(3))

    with fake_worker(wrap, db_url, keys, tmp_path, devices=3, before=queue) as (_, owner, worker, _thread):
        for job in jobs:
            wait_until(f"job {job} to run", lambda job=job: in_state(owner, job, "running"), 60)
        calls = counted[0].calls
        assert calls.get("lease") == 1, f"one request filled the three slots: {calls}"
        before = dict(calls)
        time.sleep(3.0)  # 10 heartbeat intervals of 3 leases: 30 renewals
        batches, singles = calls.get("heartbeats", 0) - before.get("heartbeats", 0), calls.get("heartbeat", 0) - before.get("heartbeat", 0)
        if batched:
            assert singles == 0 and 5 <= batches <= 20, f"{batches} batched calls and {singles} single ones for 30 renewals"
        else:
            # the batches already gathering when the first was refused are tried too (each then sent lease by lease)
            assert batches <= 3 and singles >= 20, f"{batches} batched calls and {singles} single ones for 30 renewals"
            assert 1 <= counted[0].answered <= 4, "the batched route was tried, then each lease heartbeats on its own"
        for job in jobs:
            owner.complete(job, owner.show(job)["lease_epoch"])
        wait_until("the slots to be free", lambda: not worker.busy(), 15)


class HostileListings:
    """ASGI wrapper of the scheduler standing in for a hostile one (or whoever answers in its place): every file of a
    worker's artifact listing is named ``../../../<path>``, and a download of such a name gets the real file."""

    ESCAPE = "../../../"

    def __init__(self, app: Any) -> None:
        self.app, self.on = app, False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if not (self.on and scope["type"] == "http" and path.startswith("/v1/workers/") and "/artifacts/" in path):
            return await self.app(scope, receive, send)
        if "/" + self.ESCAPE in path:  # a download of a listed name: serve the real file
            real = path.replace("/" + self.ESCAPE, "/")
            return await self.app({**scope, "path": real, "raw_path": real.encode()}, receive, send)
        start: dict[str, Any] = {}
        body = bytearray()

        async def rewrite(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            answer = bytes(body)
            if start["status"] == 200:
                listing = json.loads(answer)
                for entry in listing.get("files", []):
                    entry["path"] = self.ESCAPE + entry["path"]
                answer = json.dumps(listing).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"] + [(b"content-length", str(len(answer)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": answer})

        await self.app(scope, receive, rewrite)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_hostile_listing_cannot_place_files_outside_the_jobs_folder(db_url: str, keys: Any, tmp_path: Path) -> None:
    """The worker restores only inside the job's folder, whatever the listing says: a name such as ``../../../state.json``
    fails that job with the reason, before any download, and the worker goes on to the next job."""
    with fake_worker(HostileListings, db_url, keys, tmp_path) as (hostile, owner, _, thread):
        ended = owner.submit("train", {**CONFIG, "seed": 75})["id"]  # exits 75 after saving step_000002
        wait_until("the first job to fail", lambda: in_state(owner, ended, "failed"), 60)
        assert [c["name"] for c in owner.checkpoints(ended)] == ["step_000002"]
        hostile.on = True
        continued = owner.submit("train", {**CONFIG, "resume_job": ended})["id"]
        failed = wait_until("the continuing job to fail", lambda: in_state(owner, continued, "failed"), 60)
        assert "ArtifactPathError" in failed["error"] and "../../../" in failed["error"]
        jobs = tmp_path / "work" / "jobs"  # the worker writes only into jobs/<job>/<epoch>/; ../../../ from a restore lands in jobs/<job>/
        stray = [p for p in jobs.glob("*/*") if not p.is_dir()] + [p for p in (tmp_path / "work").rglob("state.json") if "states" not in p.parts]
        assert stray == [], stray
        hostile.on = False
        after = owner.submit("train", {**CONFIG, "seed": 75})["id"]  # the worker is still there and takes the next job
        wait_until("the next job to end", lambda: in_state(owner, after, "failed"), 60)
        assert thread.is_alive()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_4xx_answer_to_a_lease_request_never_ends_the_worker(db_url: str, keys: Any, tmp_path: Path) -> None:
    """Only a refused key (401/403) stops a worker: a 400 for one lease is logged, and the worker asks again and runs the job."""
    with fake_worker(refuse_leases, db_url, keys, tmp_path) as (refusing, owner, _, thread):
        refusing.count = 3
        job = owner.submit("train", {**CONFIG, "seed": 75})["id"]
        wait_until("the job to run and end", lambda: in_state(owner, job, "failed"), 60)  # the stand-in server exits 75
        assert refusing.answered == 3 and thread.is_alive()
