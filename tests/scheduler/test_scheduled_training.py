"""Training as a scheduler job (``tinkergym train --scheduler URL``): the client side, against a live scheduler.

The worker here is played by the test through the scheduler's real worker API (register, lease, report
running, heartbeat) around real training servers on 127.0.0.1, so the failures the client must survive can
be placed exactly: a worker that dies right after a checkpoint, a lease that expires, a second worker that
takes the job at the next epoch with the checkpoints restored (as the artifact store does).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from click.testing import CliRunner
from sqlalchemy import func, select

from tinkergym.serve.asgi import ThreadServer
from tinkergym.backends.models import resolve_model
from tinkergym.cli import main
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.db import allocations, jobs, make_engine
from tinkergym.trainers.reporting import read_metrics

VOLATILE = ("time/", "tokens/per_s")
COMMON = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "4", "--batch-size", "2", "--group-size", "4",
          "--max-new-tokens", "6", "--lr", "1e-3", "--checkpoint-every", "1", "--quiet")


class DieAfter:
    """Around a training server's app: once ``marker`` exists, every request gets 503 and ``dead`` is set (the worker dies)."""

    def __init__(self, app: Any, marker: Path | None) -> None:
        self.app, self.marker, self.dead = app, marker, threading.Event()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.marker is not None and self.marker.is_dir():
            self.dead.set()
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


class LapseOnce:
    """Around a training server's app: once ``marker`` exists, the next ``optim_step`` call is refused with 401 lease_ended (what
    a shared server answers while its worker's renewal of the adapter's lease runs late) after the step's forward_backward
    ran; every other request, and every later one, is served. The scheduler's lease lives on (the heartbeats go on)."""

    def __init__(self, app: Any, marker: Path) -> None:
        self.app, self.marker, self.lapsed = app, marker, threading.Event()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.lapsed.is_set() or scope["path"] != "/v1/call" or not self.marker.is_dir():
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        if b'"method":"optim_step"' in body:
            self.lapsed.set()
            answer = json.dumps({"error": {"type": "lease_ended", "message": "this adapter's lease has ended", "code": 401}}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
            await send({"type": "http.response.body", "body": answer})
            return None
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


class PlayedWorker(threading.Thread):
    """A worker: registers one slot, takes a lease, runs the job's training server, reports running, heartbeats.

    ``restore_from``: a run folder whose saved states are copied into this server's before it starts (what the
    artifact store does for a job moved to another worker). ``die_after``: once its run folder holds that saved
    state, the next request finds the worker dead (503, then the server and the heartbeats stop). ``lapse_after``: once its
    run folder holds that saved state, the next ``optim_step`` is refused as past the lease (:class:`LapseOnce`).
    """

    def __init__(self, scheduler: str, key: str, name: str, run_dir: Path, restore_from: Path | None = None, die_after: str | None = None,
                 lapse_after: str | None = None) -> None:
        super().__init__(daemon=True)
        self.lapse_after = lapse_after
        self.http = httpx.Client(base_url=scheduler, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        self.name, self.run_dir, self.restore_from, self.die_after = name, run_dir, restore_from, die_after
        self.lease: dict[str, Any] | None = None
        self.served: ThreadServer | None = None
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        body = {"name": name, "host": "127.0.0.1", "devices": [{"index": 0, "kind": "slot"}], "models": ["tiny"]}
        answer = self.http.post("/v1/workers", json=body)
        assert answer.status_code == 200, answer.text
        self.worker_id = answer.json()["id"]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.http.post(f"/v1/workers/{self.worker_id}{path}", json=body)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _run(self) -> None:
        from tinkergym.serve.training.app import create_app as create_server
        from tinkergym.serve.auth import token_digest
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        while self.lease is None and not self.stopped.is_set():
            self.lease = self.post("/lease", {}).json()["lease"]
            time.sleep(0.1)
        if self.lease is None:
            return
        job, epoch, config = self.lease["job_id"], self.lease["epoch"], self.lease["config"]
        assert self.post(f"/jobs/{job}/state", {"epoch": epoch, "state": "starting"}).status_code == 200
        if self.restore_from is not None:
            shutil.copytree(self.restore_from / "states", self.run_dir / "states")
        backend = TorchBackend(TorchBackendConfig(
            model=resolve_model(config["model"]), lora_rank=config["lora_rank"], lora_alpha=config["lora_alpha"], dtype=config["dtype"],
            micro_batch_size=config["micro_batch_size"], seed=config["seed"],
        ))
        marker = self.run_dir / "states" / self.die_after if self.die_after else None
        served: Any = create_server(backend, run_dir=self.run_dir, token_digest=token_digest(self.lease["token"]))
        if self.lapse_after:
            served = self.lapse = LapseOnce(served, self.run_dir / "states" / self.lapse_after)
        app = DieAfter(served, marker)
        self.served = ThreadServer(app)
        answer = self.post(f"/jobs/{job}/state", {"epoch": epoch, "state": "running", "server_url": self.served.url})
        assert answer.status_code == 200, answer.text
        recorded: set[str] = set()
        while not self.stopped.is_set():
            if app.dead.is_set():
                self.served.stop()  # killed: the server goes, the heartbeats stop, the lease runs out
                return
            self._record(job, epoch, recorded)
            if self.post(f"/jobs/{job}/heartbeat", {"epoch": epoch}).status_code != 200:
                break  # the job ended (completed by its client) or the lease was lost: stop the server
            time.sleep(0.2)
        self.served.stop()

    def _record(self, job: str, epoch: int, recorded: set[str]) -> None:
        """Record each complete state the server saved as a checkpoint (a real worker uploads its files first)."""
        states = self.run_dir / "states"
        for state in sorted(states.glob("step_*")) if states.is_dir() else []:
            if state.name not in recorded and not state.name.endswith(".tmp") and (state / "state.json").is_file():
                answer = self.post(f"/jobs/{job}/checkpoints", {"epoch": epoch, "step": int(state.name.split("_")[1]), "name": state.name})
                if answer.status_code == 200:
                    recorded.add(state.name)


@pytest.fixture
def scheduler(db_url: str, tmp_path: Path, keys: Any) -> Any:
    app = create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.1))
    served = ThreadServer(app)
    served.client_key = keys.new("acme", "read,write")
    served.worker_key = keys.new("ops", "worker")
    yield served
    served.stop()


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))


def _train(*args: str) -> None:
    result = CliRunner().invoke(main, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _job(db_url: str) -> tuple[dict[str, Any], int]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            job = dict(conn.execute(select(jobs)).mappings().one())
            held = conn.execute(select(func.count()).select_from(allocations)).scalar_one()
    finally:
        engine.dispose()
    return job, held


def _train_on_two_workers(scheduler: Any, tmp_path: Path, *args: str) -> tuple[PlayedWorker, PlayedWorker]:
    """``train *COMMON *args`` through ``scheduler`` while worker w1 takes the job and dies after step 1, and w2, started
    once w1 holds the lease, takes it over from w1's states; both workers, after the run."""
    first = PlayedWorker(scheduler.url, scheduler.worker_key, "w1", tmp_path / "w1", die_after="step_000001")
    second = PlayedWorker(scheduler.url, scheduler.worker_key, "w2", tmp_path / "w2", restore_from=tmp_path / "w1")
    first.start()
    try:
        def second_after_first() -> None:  # w1 takes the job first; w2 then waits for the next lease
            while first.lease is None and not first.stopped.is_set():
                time.sleep(0.05)
            second.start()

        threading.Thread(target=second_after_first, daemon=True).start()
        _train(*COMMON, *args, "--scheduler", scheduler.url, "--api-key", scheduler.client_key)
    finally:
        first.stopped.set()
        second.stopped.set()
        first.join(timeout=30)
        if second.is_alive():
            second.join(timeout=30)
    assert first.error is None and second.error is None, (first.error, second.error)
    return first, second


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_scheduled_run_survives_its_worker_and_equals_a_local_run(scheduler: Any, db_url: str, tmp_path: Path) -> None:
    local, scheduled = tmp_path / "local", tmp_path / "scheduled"
    _train(*COMMON, "--out", str(local))
    first, second = _train_on_two_workers(scheduler, tmp_path, "--out", str(scheduled))
    assert first.lease["epoch"] == 1 and second.lease["epoch"] == 2 and second.lease["attempt"] == 1
    assert _stable(read_metrics(scheduled / "metrics.jsonl")) == _stable(read_metrics(local / "metrics.jsonl"))
    assert sorted(p.name for p in (scheduled / "final").iterdir()) == sorted(p.name for p in (local / "final").iterdir())
    config = json.loads((scheduled / "config.json").read_text())
    job, held = _job(db_url)
    assert config["scheduler_job"] == job["id"] and config["scheduler_url"] == scheduler.url
    assert scheduler.client_key not in (scheduled / "config.json").read_text()
    assert job["state"] == "succeeded" and job["lease_epoch"] == 2 and held == 0  # completed by the client: devices free at once
    assert json.loads(job["config"])["model"] == "tiny"
    # The client's steps are in the job's event stream (what `tinkergym jobs logs --follow` shows), each step at least
    # once (the steps run again after the lost server appear twice).
    steps = [e["data"]["step"] for e in _events(scheduler.url, scheduler.client_key, job["id"]) if e["type"] == "metrics"]
    assert set(steps) == {0, 1, 2, 3} and steps[-1] == 3


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_scheduled_run_samples_ahead_from_its_servers_snapshots_and_survives_its_worker(scheduler: Any, db_url: str, tmp_path: Path) -> None:
    """--async-steps 2 through the scheduler: rollouts sample from snapshots the job's server holds; the first worker dies
    after step 1, its snapshots with it, and the run goes on from its checkpoint on the second worker's server, sampling
    from that server's snapshots. Each sitting samples its first K + 1 steps from the weights it starts with, so with two
    steps a sitting the gaps are 0 or 1 (0 where the step before trained nothing), never more than K."""
    out = tmp_path / "scheduled"
    _, second = _train_on_two_workers(scheduler, tmp_path, "--out", str(out), "--async-steps", "2", "--old-logprobs", "sampler")
    assert second.lease["epoch"] == 2
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 0}  # the last record of a step that ran twice
    assert sorted(records) == [0, 1, 2, 3]
    gaps = [records[s]["async/version_gap_max"] for s in range(4)]
    assert gaps[0] == 0.0 and all(g <= 1.0 for g in gaps) and 1.0 in gaps, gaps
    job, held = _job(db_url)
    assert job["state"] == "succeeded" and held == 0


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_call_refused_while_the_lease_lives_goes_on_with_the_same_server(scheduler: Any, db_url: str, tmp_path: Path) -> None:
    """A server that refuses one call as past its lease while the scheduler still holds the lease (a worker's late renewal)
    is the job's server all the same: the client connects to it again (no new epoch comes), loads its newest checkpoint,
    which drops the gradients of the refused step's forward_backward, and the run equals the local one."""
    local, scheduled = tmp_path / "local", tmp_path / "scheduled"
    _train(*COMMON, "--out", str(local))
    # refused: the optim_step of step 1 (the one step after step 0's checkpoint that trains here: the next two tie)
    worker = PlayedWorker(scheduler.url, scheduler.worker_key, "w1", tmp_path / "w1", lapse_after="step_000000")
    worker.start()
    done: list[Any] = []
    client = threading.Thread(daemon=True, target=lambda: done.append(CliRunner().invoke(
        main, ["train", *COMMON, "--out", str(scheduled), "--scheduler", scheduler.url, "--api-key", scheduler.client_key])))
    client.start()
    try:
        client.join(timeout=180)
        assert done, "the run waited for a new lease although the job's lease and server lived on"
    finally:
        worker.stopped.set()
        worker.join(timeout=30)
    assert done[0].exit_code == 0, done[0].output
    assert worker.error is None and worker.lapse.lapsed.is_set()
    assert "did not answer" in done[0].output and "epoch 1" in done[0].output
    assert _stable(read_metrics(scheduled / "metrics.jsonl")) == _stable(read_metrics(local / "metrics.jsonl"))
    job, held = _job(db_url)
    assert job["state"] == "succeeded" and job["lease_epoch"] == 1 and held == 0


def _events(url: str, key: str, job_id: str) -> list[dict[str, Any]]:
    from tinkergym.client import SchedulerClient

    with SchedulerClient(url, key) as client:
        return client.events(job_id)


def test_client_events_are_the_owners_only_and_bounded(scheduler: Any, keys: Any) -> None:
    from tinkergym.client import SchedulerClient, SchedulerError

    owner = SchedulerClient(scheduler.url, scheduler.client_key)
    stranger = SchedulerClient(scheduler.url, keys.new("globex", "read,write"))
    reader = SchedulerClient(scheduler.url, keys.new("acme", "read"))
    job = owner.submit("train", {"model": "tiny"})
    assert owner.report(job["id"], "metrics", {"step": 0, "loss": 1.5}) > 1
    for client, status in ((stranger, 404), (reader, 403)):
        with pytest.raises(SchedulerError) as refused:
            client.report(job["id"], "metrics", {"step": 0})
        assert refused.value.status == status
    with pytest.raises(SchedulerError) as big:
        owner.report(job["id"], "log", {"text": "x" * 70_000})
    assert big.value.status == 413 and "max_event_bytes" in str(big.value)  # the tenant's quota (64 KiB unless raised)
    owner.cancel(job["id"])
    with pytest.raises(SchedulerError) as ended:
        owner.report(job["id"], "log", {"text": "late"})
    assert ended.value.status == 409


def test_the_scheduler_refuses_a_path_as_the_model_and_a_bad_key(scheduler: Any, tmp_path: Path, tiny: str) -> None:
    args = [a if a != "tiny" else tiny for a in COMMON]
    result = CliRunner().invoke(main, ["train", *args, "--out", str(tmp_path / "a"), "--scheduler", scheduler.url, "--api-key", scheduler.client_key])
    assert result.exit_code == 2 and "not a model name" in result.output, result.output
    result = CliRunner().invoke(main, ["train", *COMMON, "--out", str(tmp_path / "b"), "--scheduler", scheduler.url, "--api-key", "tgk_nope"])
    assert result.exit_code == 2 and "refused the API key" in result.output, result.output
    result = CliRunner().invoke(main, ["train", *COMMON, "--out", str(tmp_path / "c"), "--api-key", scheduler.client_key])
    assert result.exit_code == 2 and "--scheduler" in result.output, result.output
