"""The front door's runs (:class:`~tinkergym.tinker_api.cluster.ClusterEngine`) follow their jobs from a worker that dies or
freezes to the next one, where a call that found the server gone would not: a state saved but never stored, and a run
whose client only sends heartbeats.

- The engine saves a run's state every ``checkpoint_every`` steps and waits until the scheduler holds it. A worker frozen
  (SIGSTOP) right before such a step: its server still answers until its lease file's deadline, so the step and the save
  succeed there, but the frozen worker never uploads the state and the scheduler records nothing from a lease it has moved
  past. The wait must end as soon as the lease is gone (not after :data:`~tinkergym.tinker_api.cluster.STORE_WAIT_S`), the
  run move to a second worker (its log replayed) and the state be stored from there.
- A client thinking in a notebook sends no call, only heartbeats, and the engine pings its run's server
  (:meth:`~tinkergym.tinker_api.cluster.ClusterEngine.keepalive`). When the worker dies meanwhile, the keep-alive must bring
  the job's next server to the run's state, and keep it alive past the scheduler's idle timeout.

Either way the run then goes on as one that was never interrupted.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from workerkit import serve_scheduler, shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

#: The scheduler's idle timeout in the keep-alive test: the client sends no call for longer than that.
IDLE_TIMEOUT = 20.0
ROWS = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44]]


def _request() -> Any:
    from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec

    return ForwardBackwardRequest(data=[Datum(tokens=r, loss_mask=[0.0] * 3 + [1.0] * (len(r) - 3)) for r in ROWS],
                                  loss=LossSpec(name="cross_entropy"))


def _loss(engine: Any, handle: Any) -> float:
    return float(engine.call(handle, "forward_backward", {"request": _request()})["metrics"]["loss"])


def _step(engine: Any, handle: Any) -> float:
    from tinkergym.protocol.types import OptimParams

    loss = _loss(engine, handle)
    engine.call(handle, "optim_step", {"params": OptimParams(learning_rate=3e-2)})
    return loss


def _stop(engine: Any, handles: list[Any], workers: list[Any], scheduler: Any) -> None:
    """End the runs' jobs, kill the workers still running, stop the scheduler."""
    for handle in handles:
        engine.close(handle)
    for process in workers:
        if process.poll() is None:
            process.kill()
            process.wait()
    scheduler.stop()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_state_whose_worker_froze_before_storing_it_is_stored_from_the_next_lease(db_url: str, keys: Any, tiny: str, tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.client import SchedulerClient
    from tinkergym.tinker_api import cluster as cluster_module
    from tinkergym.tinker_api.cluster import ClusterEngine

    monkeypatch.setattr(cluster_module, "STORE_WAIT_S", 90.0)  # without the lease check the wait ends here, the state not stored
    cache = tmp_path / "cache"
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = serve_scheduler(db_url, tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2)
    said: list[str] = []
    engine = ClusterEngine(scheduler.url, {"tiny": tiny}, tmp_path / "door", checkpoint_every=2, dtype="float32", poll=0.2, say=said.append)
    first = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=2)
    workers = [first]
    handles: list[Any] = []
    try:
        handles.append(engine.open_run("run-a", "tiny", 4, 3, alice))
        run = handles[0]
        losses = [_step(engine, run)]  # step 1: no state yet
        assert run.stored is None and len(run.log) == 2
        workers.append(shared_worker(scheduler.url, worker_key, tmp_path / "w2", cache, seats=2))  # takes the job once w1's lease is gone
        losses.append(_loss(engine, run))

        first.send_signal(signal.SIGSTOP)  # frozen: it renews no lease and uploads nothing; its server answers until the deadline
        from tinkergym.protocol.types import OptimParams

        engine.call(run, "optim_step", {"params": OptimParams(learning_rate=3e-2)})  # step 2: its state auto-000002 saved, then stored

        owner = SchedulerClient(scheduler.url, alice)
        assert any("lost the lease before its worker stored checkpoint auto-000002" in line for line in said), said
        assert run.stored == "auto-000002" and run.log == []  # stored from the second lease's server: the log before it dropped
        recorded = {c["name"]: c for c in owner.checkpoints(run.job_id)}
        assert recorded["auto-000002"]["epoch"] >= 2, recorded
        assert owner.show(run.job_id)["lease_epoch"] >= 2
        losses.append(_step(engine, run))  # step 3, on the second worker

        # the same three steps on a job nobody interrupted: the same losses
        handles.append(engine.open_run("run-b", "tiny", 4, 3, alice))
        straight = [_step(engine, handles[1]) for _ in range(3)]
        assert losses[0] == pytest.approx(straight[0], rel=1e-4)
        assert losses[1] == pytest.approx(straight[1], rel=1e-4)
        assert losses[2] == pytest.approx(straight[2], rel=1e-4)
        assert straight[2] != pytest.approx(straight[0], rel=1e-3)  # the steps changed the weights: the check can tell runs apart
        owner.close()
    finally:
        first.send_signal(signal.SIGCONT)
        _stop(engine, handles, workers, scheduler)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_an_idle_clients_run_follows_its_job_to_the_next_worker_on_keep_alives_alone(db_url: str, keys: Any, tiny: str, tmp_path: Path) -> None:
    from tinkergym.client import SchedulerClient
    from tinkergym.tinker_api.cluster import ClusterEngine

    cache = tmp_path / "cache"
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    scheduler = serve_scheduler(db_url, tmp_path / "data", lease_ttl_s=3.0, sweep_interval_s=0.2, idle_timeout_s=IDLE_TIMEOUT)
    said: list[str] = []
    engine = ClusterEngine(scheduler.url, {"tiny": tiny}, tmp_path / "door", checkpoint_every=2, dtype="float32", poll=0.2, say=said.append)
    first = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=2)
    workers = [first]
    handles: list[Any] = []
    owner = SchedulerClient(scheduler.url, alice)
    try:
        handles.append(engine.open_run("run-a", "tiny", 4, 3, alice))
        run = handles[0]
        losses = [_step(engine, run) for _ in range(3)]  # a stored state (auto-000002) and the calls of a step after it
        assert run.stored == "auto-000002" and len(run.log) == 2
        workers.append(shared_worker(scheduler.url, worker_key, tmp_path / "w2", cache, seats=2))
        first.kill()
        first.wait()

        def keep_alive_until(done: Any, seconds: float) -> None:  # what the service's maintenance pass does for a live session
            deadline = time.monotonic() + seconds
            while not done() and time.monotonic() < deadline:
                engine.keepalive(run)
                time.sleep(1.0)

        keep_alive_until(lambda: run.backend.epoch >= 2 and not run.behind, 150)
        assert run.backend.epoch >= 2 and not run.behind, said[-5:]
        assert any("its server is gone while its client is idle" in line for line in said), said
        keep_alive_until(lambda: False, IDLE_TIMEOUT + 5)  # no call for longer than the idle timeout: the keep-alives alone
        job = owner.show(run.job_id)
        assert job["state"] == "running" and job["lease_epoch"] == run.backend.epoch, job
        losses.append(_step(engine, run))  # step 4, on the second worker, from the stored state and the replayed step

        handles.append(engine.open_run("run-b", "tiny", 4, 3, alice))
        straight = [_step(engine, handles[1]) for _ in range(4)]
        for got, want in zip(losses, straight):
            assert got == pytest.approx(want, rel=1e-4)
        assert straight[3] != pytest.approx(straight[2], rel=1e-3)
    finally:
        owner.close()
        _stop(engine, handles, workers, scheduler)
