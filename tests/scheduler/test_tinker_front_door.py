"""The Tinker API in front of a scheduler (`serve tinker --scheduler`): the official SDK (its sync and async interfaces) trains
and samples through one base URL while each run and sampler is a job on a real worker's shared server; the worker is killed mid-run, a second one takes
the job, and every step's loss, the final weights and the sampler's logprobs equal the same run on a local serve tinker. A
client that only sends heartbeats for longer than the scheduler's idle timeout keeps its job (the front door's keep-alive)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy

pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")

from sqlalchemy import select  # noqa: E402

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.db import jobs, make_engine  # noqa: E402
from tinkergym.serve.asgi import ThreadServer  # noqa: E402
from workerkit import shared_worker  # noqa: E402  # registered by tests/scheduler/conftest.py

pytestmark = pytest.mark.slow

ROWS = [list(range(5, 21)), [7, 3, 9, 11, 40, 41, 42, 43, 44], list(range(100, 112))]
STEPS = 6
KILL_AFTER = 3
#: The scheduler's idle timeout here: the client then only sends heartbeats for IDLE_MARGIN seconds longer (the front door keeps the job
#: alive; without it the job would end within a worker's scan, half a second, of the timeout, and the next step fail).
#: It also bounds how long the front door may take to reach the job's next server after the first worker is killed (its
#: call to the dead server ends, it waits for the new lease, it loads the state), which took more than 20 s on a loaded
#: 2-core machine: the seat then ended as idle before its client came.
IDLE_TIMEOUT = 45.0
IDLE_MARGIN = 5.0


def _datums() -> list[Any]:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
            for r in ROWS]


def _train(url: str, key: str, model: str, on_step: Any = None, idle: float = 0.0) -> tuple[list[float], list[np.ndarray], list[list[float]], list[float], dict, list[float]]:
    """The client's session: STEPS steps (a state saved after the second), a sampler of the end weights, its samples' logprobs,
    the end weights as downloaded through save_weights_external's signed URLs, the losses of a run created from the
    saved state's weights only (fresh Adam moments) over two steps, with the same weights loaded again (weights only) after
    the first, and the losses of two steps of a run created from the whole saved state."""
    from tinker import types

    async def async_step(training: Any) -> float:  # the SDK's async interface (its futures awaited): odd steps and the sampler
        fwd = training.forward_backward(_datums(), "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=3e-2))
        loss = (await fwd).metrics["loss:sum"]
        await optim
        return loss

    async def async_sample(sampler: Any) -> Any:
        return await sampler.sample(types.ModelInput.from_ints(ROWS[0][:4]), 2, types.SamplingParams(max_tokens=5, seed=7))

    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        training = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
        losses = []
        for step in range(STEPS):
            if step % 2:
                losses.append(asyncio.run(async_step(training)))
            else:
                fwd = training.forward_backward(_datums(), "cross_entropy")
                optim = training.optim_step(types.AdamParams(learning_rate=3e-2))
                losses.append(fwd.result().metrics["loss:sum"])
                optim.result()
            if step == 1:
                state = training.save_state("after-two").result().path
            if on_step is not None:
                on_step(step)
            if step == 0 and idle:  # only the SDK's heartbeats for longer than the scheduler's idle timeout: the job must stay
                time.sleep(idle)
        final = [o["logprobs"].to_numpy() for o in training.forward(_datums(), "cross_entropy").result().loss_fn_outputs]
        sampler = training.save_weights_and_get_sampling_client().result()
        sampled = asyncio.run(async_sample(sampler))
        scored = [sampler.compute_logprobs(types.ModelInput.from_ints(ROWS[0][:4] + s.tokens)).result()[4:] for s in sampled.sequences]
        exported = training.save_weights_external("end").result().path
        urls = tinker.RestClient(base_url=url, api_key=key).get_external_weights_urls(exported).result().urls
        weights = safetensors.numpy.load(httpx.get(urls["adapter_model.safetensors"], timeout=60).content)  # not httpx's 5 s: a loaded machine
        fresh = service.create_training_client_from_state(state).result()
        fresh_losses = []
        for again in range(2):
            fwd = fresh.forward_backward(_datums(), "cross_entropy")
            fresh.optim_step(types.AdamParams(learning_rate=3e-2)).result()
            fresh_losses.append(fwd.result().metrics["loss:sum"])
            if again == 0:
                fresh.load_state(state).result()  # its weights again; its Adam moments and step stay the run's
        fresh_losses.append(fresh.forward_backward(_datums(), "cross_entropy").result().metrics["loss:sum"])
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        for _ in range(2):
            fwd = resumed.forward_backward(_datums(), "cross_entropy")
            resumed.optim_step(types.AdamParams(learning_rate=3e-2)).result()
            fresh_losses.append(fwd.result().metrics["loss:sum"])
        return losses, final, [s.logprobs for s in sampled.sequences], [v for row in scored for v in row], weights, fresh_losses


@pytest.mark.filterwarnings("ignore:DEPRECATED.*load_state:FutureWarning")  # TrainingClient.load_state: still the SDK's, still served
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_sdk_through_the_front_door_survives_a_killed_worker(db_url: str, keys: Any, tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.tinker_api.server import create_front_door, create_server

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    tokenizer = resolve_model("tiny")
    alice, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    engine = make_engine(db_url)
    logger = logging.getLogger("tinker-front-door-test")

    # the same session on a local serve tinker: what the cluster must answer
    base = SharedBase(SharedBaseConfig(model="tiny", dtype="float32", micro_batch_size=16, max_sessions=8))
    local = ThreadServer(create_server(base, tmp_path / "local", engine, logger, model_name="tiny", tokenizer_id=tokenizer))
    try:
        expected = _train(local.url, "tml-" + alice, "tiny")
    finally:
        local.stop()

    scheduler = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=6.0, sweep_interval_s=0.2,
                                                          idle_timeout_s=IDLE_TIMEOUT)))
    door = ThreadServer(create_front_door(scheduler.url, {"tiny": tokenizer}, tmp_path / "door", engine, logger, dtype="float32",
                                          checkpoint_every=2, maintenance_s=1.0))
    first = shared_worker(scheduler.url, worker_key, tmp_path / "w1", cache, seats=4)  # the run, its sampler, two runs from its state
    workers = [first]

    def kill_first(step: int) -> None:
        if step == KILL_AFTER - 1:
            first.send_signal(signal.SIGKILL)
            first.wait()
            workers.append(shared_worker(scheduler.url, worker_key, tmp_path / "w2", cache, seats=4))

    try:
        got = _train(door.url, "tml-" + alice, "tiny", on_step=kill_first, idle=IDLE_TIMEOUT + IDLE_MARGIN)
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
        door.stop()
        scheduler.stop()
    losses, final, sampled, scored, weights, fresh_losses = got
    # weights only: the run starts at the saved weights (the loss of step 3), then goes elsewhere than with the Adam moments
    np.testing.assert_allclose(fresh_losses, expected[5], rtol=1e-4)
    assert fresh_losses[0] == pytest.approx(losses[2], rel=1e-4) and fresh_losses[1] == pytest.approx(losses[2], rel=1e-4)
    assert abs(fresh_losses[2] - losses[3]) > 1e-3 * abs(losses[3])
    np.testing.assert_allclose(fresh_losses[3:], losses[2:4], rtol=1e-4)  # with the Adam moments: as the run went on
    assert sorted(weights) == sorted(expected[4]) and weights
    for name, value in weights.items():  # the adapter the front door's job exported is the local run's
        np.testing.assert_allclose(value, expected[4][name], atol=1e-4)
    np.testing.assert_allclose(losses, expected[0], rtol=1e-4)
    for a, b in zip(final, expected[1]):
        np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(sampled), np.concatenate(expected[2]), atol=1e-4)  # seeded: the same draws
    np.testing.assert_allclose(scored, np.concatenate(sampled), atol=1e-4)
    with engine.connect() as conn:
        rows = conn.execute(select(jobs.c.tenant_id, jobs.c.lease_epoch, jobs.c.state, jobs.c.config)).all()
    engine.dispose()
    assert {r.tenant_id for r in rows} == {"acme"}  # the jobs are the key's tenant's
    assert max(r.lease_epoch for r in rows) >= 2, "no job moved to the second worker"
    assert len(rows) >= 2  # the run, and the sampler's job
