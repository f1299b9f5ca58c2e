"""A worker never fails a user's job for its own faults, and keeps little on disk: ``tinkergym worker`` subprocesses against
a live scheduler, their job servers a stand-in (:data:`FAKE_PYTHON`, given as ``--python``; no torch needed).

- A worker that cannot run what it offers (the servers' packages, a model, a GPU) refuses to start with one line.
- A server that exits with the environment-fault code gives the job back at the same attempt, the worker is quarantined
  with the reason, and another worker runs the job; a config the server refuses fails the job with one line.
- A job that ends normally leaves no warning in the worker's log and no folder; its uploaded states are pruned as it
  saves new ones; an idle worker logs nothing per lease poll.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from testkit import wait_until  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import make_engine

from tinkergym.client import SchedulerClient, SchedulerError
from workerkit import WorkerProcess, stored_job  # registered by conftest.py

CONFIG = {"model": "tiny", "dtype": "float32", "lora_rank": 4, "seed": 0}

#: Stands in for the worker's Python: ``-c`` (the worker's start-up check) runs the real one; ``-m tinkergym serve backend``
#: is a fake server whose behaviour the job's seed picks; a copy named ``*broken*`` cannot run on this machine (exit 69).
FAKE_PYTHON = r'''
import http.server, json, os, sys, threading, time
if sys.argv[1] == "-c":
    os.execv(REAL, [REAL, *sys.argv[1:]])
args = sys.argv[sys.argv.index("serve") + 2:]  # after `serve backend`
opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
run, seed = opt["--run-dir"], int(opt["--seed"])
if "broken" in os.path.basename(sys.argv[0]):
    print("loading the model", flush=True)
    print("error: a package the server needs does not import here: ModuleNotFoundError: No module named 'uvicorn'", file=sys.stderr, flush=True)
    sys.exit(69)
if seed == 2:
    print("Traceback (most recent call last):\n  File \"serve.py\", line 1\nValueError: fake trace", flush=True)
    print("Error: --lora-alpha 0.0: must be positive", flush=True)
    sys.exit(2)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass

server = http.server.ThreadingHTTPServer((opt["--host"], int(opt["--port"])), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
for step in range(1, seed + 1):  # seed N: N states, each a new one once the one before is uploaded and recorded
    while step > 1 and not os.path.exists(os.path.join(run, "uploaded", str(step - 1))):
        time.sleep(0.05)
    tmp = os.path.join(run, "states", f"step_{step:06d}.tmp")
    os.makedirs(tmp)
    open(os.path.join(tmp, "state.json"), "w").write(json.dumps({"step": step}))
    open(os.path.join(tmp, "weights.bin"), "wb").write(os.urandom(20000))
    os.replace(tmp, os.path.join(run, "states", f"step_{step:06d}"))
time.sleep(3600)
'''


wait_for = partial(wait_until, timeout=90.0)


def fake_python(folder: Path, name: str = "fake-python") -> Path:
    path = folder / name
    path.write_text(f"#!{sys.executable}\nREAL = {sys.executable!r}\n{FAKE_PYTHON}")
    path.chmod(0o755)
    return path


class LeasePolls:
    """ASGI wrapper of the scheduler counting the workers' lease requests."""

    def __init__(self, app: Any) -> None:
        self.app, self.count = app, 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").endswith("/lease"):
            self.count += 1
        await self.app(scope, receive, send)




class Cluster:
    """A scheduler on 127.0.0.1, an owner's client, and the workers started in a test. No test here waits for a lease to
    expire, so the lease outlives a loaded machine's pauses (10 s, renewed every 0.3 s): an expiry would count an attempt
    that the tests assert was not counted."""

    def __init__(self, db_url: str, keys: Any, tmp_path: Path) -> None:
        self.db_url, self.tmp_path = db_url, tmp_path
        self.polls = LeasePolls(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=10.0, sweep_interval_s=0.2)))
        self.server = ThreadServer(self.polls)
        self.owner = SchedulerClient(self.server.url, keys.new("acme", "read,write"))
        self.key = keys.new("acme", "worker")
        self.workers: list[WorkerProcess] = []

    def worker(self, name: str, python: Path, *extra: str) -> WorkerProcess:
        started = WorkerProcess(self.server.url, self.key, self.tmp_path / name, name, "--python", str(python), *extra,
                                heartbeat="0.3", poll="0.1", ports="30000-39999")
        self.workers.append(started)
        return started

    def state(self, job_id: str, state: str) -> dict[str, Any] | None:
        job = self.owner.show(job_id)
        return job if job["state"] == state else None

    def row(self, sql: str, **params: Any) -> Any:
        from sqlalchemy import text

        engine = make_engine(self.db_url)
        try:
            with engine.connect() as conn:
                return conn.execute(text(sql), params).first()
        finally:
            engine.dispose()

    def close(self, failed: bool) -> None:
        for started in self.workers:
            started.stop()
            if failed:
                sys.stderr.write(f"----- {started.folder.name} -----\n{started.text()[-6000:]}\n")
        self.owner.close()
        self.server.stop()


@pytest.fixture
def cluster(db_url: str, keys: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    made = Cluster(db_url, keys, tmp_path)
    failed = True
    try:
        yield made
        failed = False
    finally:
        made.close(failed)


def refusal(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run ``tinkergym worker`` with ``args`` (a scheduler that is never reached); its one line on stderr, exit code 2 checked."""
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", "http://127.0.0.1:9", "--work-dir", str(tmp_path / "w"), *args]
    done = subprocess.run(command, env={**os.environ, "TINKERGYM_API_KEY": "tgk_000000000000_" + "A" * 43, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-3000:])
    assert not (tmp_path / "w").exists()
    return lines[0]


def without_uvicorn(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import uvicorn (an install without the server extra)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['uvicorn'] = None\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.slow
def test_a_worker_that_cannot_run_what_it_offers_refuses_to_start(tmp_path: Path) -> None:
    """The servers' packages, each model of --models and each GPU of --gpus are checked before the worker registers."""
    line = refusal(["--slots", "1", "--models", "tiny"], tmp_path, without_uvicorn(tmp_path))
    assert "uvicorn" in line and "pip install" in line, line
    line = refusal(["--gpus", "1000", "--models", "tiny"], tmp_path)
    assert "--gpus 1000" in line, line
    line = refusal(["--slots", "1", "--models", "tiny,nobody/no-such-model"], tmp_path)
    assert "--models nobody/no-such-model" in line and "--models tiny" not in line, line


def test_a_server_that_cannot_run_here_exits_with_the_environment_code(tmp_path: Path) -> None:
    """``serve backend`` on a machine without uvicorn, serve model of a model the machine lacks: exit code 69 and one line,
    which a worker reads as its own fault."""
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "tinkergym", "serve", "backend", "--model", "tiny", "--token-file", str(token),
                           "--run-dir", str(tmp_path / "run"), "--port", "29999"], env={**os.environ, **without_uvicorn(tmp_path)},
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 69 and len(lines) == 1 and "uvicorn" in lines[0], (done.returncode, done.stderr[-3000:])
    done = subprocess.run([sys.executable, "-m", "tinkergym", "serve", "model", "--model", "nobody/no-such-model", "--api-key-file", str(token),
                           "--engine", "torch", "--port", "29999"], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 69 and len(lines) == 1 and "nobody/no-such-model" in lines[0], (done.returncode, done.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_server_that_cannot_run_here_gives_the_job_back(cluster: Cluster, tmp_path: Path) -> None:
    """Exit code 69 at start: the job is queued again at the same attempt, the worker is quarantined with the reason (and
    exits saying so), the job's events name it, and another worker runs the job."""
    broken = cluster.worker("w1", fake_python(tmp_path, "broken-python"))
    job = cluster.owner.submit("train", CONFIG)["id"]
    wait_for("the broken worker to stop", lambda: broken.process.poll() is not None)
    assert broken.process.returncode == 2, broken.text()
    assert "quarantined" in broken.text() and "Traceback" not in broken.text()
    shown = cluster.owner.show(job)
    assert shown["state"] == "queued" and shown["attempt"] == 0, shown
    w1 = cluster.row("SELECT id, quarantined_at, quarantine_reason FROM workers WHERE name = 'w1'")
    assert w1.quarantined_at is not None and "uvicorn" in w1.quarantine_reason
    given_back = [e["data"] for e in cluster.owner.events(job) if e["type"] == "log" and e["data"].get("worker") == w1.id]
    assert given_back and "uvicorn" in given_back[0]["reason"], cluster.owner.events(job)

    cluster.worker("w2", fake_python(tmp_path))
    running = wait_for("another worker to run the job", lambda: cluster.state(job, "running"))
    assert running["attempt"] == 0 and running["lease_epoch"] == 2
    cluster.owner.complete(job, 2)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_config_the_job_cannot_start_with_fails_it_with_one_line(cluster: Cluster, tmp_path: Path) -> None:
    """The job's own faults fail it with one line (the server's log goes to the worker's log); the worker goes on."""
    worker = cluster.worker("w1", fake_python(tmp_path))
    refused = cluster.owner.submit("train", {**CONFIG, "seed": 2})["id"]  # the server exits 2: a setting it refuses
    failed = wait_for("the refused job to fail", lambda: cluster.state(refused, "failed"))
    assert "\n" not in failed["error"] and "--lora-alpha 0.0: must be positive" in failed["error"], failed["error"]
    assert "ValueError: fake trace" in worker.text()  # the log's tail is the operator's, in the worker's log
    with pytest.raises(SchedulerError, match="lora_rank"):  # refused at submission now
        cluster.owner.submit("train", {**CONFIG, "lora_rank": "x"})
    bad = stored_job(cluster.db_url, {**CONFIG, "lora_rank": "x"})  # stored before that check: refused before any server starts
    failed = wait_for("the bad job to fail", lambda: cluster.state(bad, "failed"))
    assert "\n" not in failed["error"] and "lora_rank" in failed["error"], failed["error"]
    assert failed["attempt"] == 0 and worker.process.poll() is None
    assert cluster.row("SELECT quarantined_at FROM workers WHERE name = 'w1'").quarantined_at is None


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_completed_job_leaves_no_warning_and_no_folder(cluster: Cluster, tmp_path: Path) -> None:
    """Saved states are pruned to --keep-states once uploaded; completing the job ends it quietly and removes its folder;
    an idle worker writes nothing per lease poll."""
    worker = cluster.worker("w1", fake_python(tmp_path), "--keep-states", "2")
    job = cluster.owner.submit("train", {**CONFIG, "seed": 6})["id"]
    wait_for("the job to run", lambda: cluster.state(job, "running"))
    run_dir = worker.folder / "work" / "jobs" / job / "1"
    states = run_dir / "states"

    def recorded() -> int:
        names = [c["name"] for c in cluster.owner.checkpoints(job)]
        (run_dir / "uploaded").mkdir(exist_ok=True)
        for name in names:  # tell the stand-in server to save its next state
            (run_dir / "uploaded" / str(int(name.split("_")[1]))).touch()
        return len(names) == 6

    wait_for("six checkpoints", recorded)
    kept = wait_for("the older states to be pruned", lambda: (lambda names: names if len(names) <= 2 else None)(sorted(os.listdir(states))))
    assert kept == ["step_000005", "step_000006"]

    cluster.owner.complete(job, 1)
    wait_for("the job's folder to go", lambda: not (worker.folder / "work" / "jobs" / job).exists())
    wait_for("the worker to free its device", lambda: "devices [0] are free" in worker.text())
    text = worker.text()
    assert " WARNING " not in text and " ERROR " not in text, text

    lines, polls = len(worker.text().splitlines()), cluster.polls.count
    wait_for("twenty idle lease polls", lambda: cluster.polls.count >= polls + 20)
    assert len(worker.text().splitlines()) == lines, worker.text()
