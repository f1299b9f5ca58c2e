"""Memory before a lease: a worker registers its devices' memory and its models' shapes, and a training job that cannot
fit a worker's devices is never sent there. It waits with ``too_little_memory`` (the figures, and what to change), or
is refused at submission with ``--refuse-unplaceable``. The same job on more devices (sharded), or with LoRA, fits."""

from __future__ import annotations

from typing import Any

import pytest

import workerkit as kit  # registered by conftest.py
from tinkergym.backends.torch.sizing import estimate_training_memory, static_estimate

GiB = 2**30
smollm2_config = kit.smollm2_config


@pytest.fixture(scope="module")
def shape() -> dict[str, Any]:
    return kit.smollm2_shape()


@pytest.mark.parametrize(("rank", "ranks", "dtype", "device"), [(0, 1, "float32", "cpu"), (8, 1, "bfloat16", "cuda"), (0, 2, "auto", "cuda"),
                                                               (16, 4, "auto", "cpu")])
def test_the_static_estimate_of_a_shape_is_the_servers_check(shape: dict[str, Any], rank: int, ranks: int, dtype: str, device: str) -> None:
    """What the scheduler prices from a worker's shape is what serve backend prices from the model's config at its start."""
    ours = static_estimate(shape, lora_rank=rank, dtype=dtype, ranks=ranks, device=device)
    theirs = estimate_training_memory(smollm2_config(), lora_rank=rank, dtype=dtype, micro_batch_size=1, max_seq_len=1, ranks=ranks, device=device)
    assert ours.per_rank == theirs.per_rank and ours.describe() == theirs.describe()


def register(client: Any, key: str, name: str, memory_gb: float | None, shapes: dict[str, Any], devices: int = 2, kind: str = "slot") -> Any:
    body = {"name": name, "host": "127.0.0.1", "models": ["smol"], "model_shapes": shapes,
            "devices": [{"index": i, "kind": kind, **({"memory_gb": memory_gb} if memory_gb else {})} for i in range(devices)]}
    response = client.post("/v1/workers", json=body, headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return kit.Worker(client, key, response.json()["id"], body)


def submit(client: Any, key: str, gpus: int = 1, **config: Any) -> Any:
    return client.post("/v1/jobs", json={"kind": "train", "config": {"model": "smol", **config}, "gpus": gpus}, headers=kit.auth(key))


def wait_reason(client: Any, key: str, job_id: str) -> dict[str, str]:
    response = client.get(f"/v1/jobs/{job_id}", headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return response.json()["wait_reason"]


def test_a_job_that_cannot_fit_waits_with_the_figures_and_the_worker_never_gets_it(make_client: Any, keys: Any, shape: dict[str, Any]) -> None:
    client = make_client()
    user = keys.new("acme", "read,write")
    # Full fine-tuning of 135M parameters in float32 on a CPU slot keeps about 2.0 GiB (weights, gradients, Adam's two
    # moments); each slot here has 1.5 GiB (1.35 usable).
    worker = register(client, keys.worker(8), "small", 1.5, {"smol": shape})
    full = submit(client, user, lora_rank=0, dtype="float32").json()["id"]
    why = wait_reason(client, user, full)
    assert why["code"] == "too_little_memory", why
    expected = static_estimate(shape, lora_rank=0, dtype="float32", ranks=1, device="cpu")
    assert f"{expected.per_rank / GiB:.2f} GiB per device" in why["message"] and "1.50 GiB" in why["message"]
    assert "LoRA instead of full fine-tuning" in why["message"] and "2 devices" in why["message"], "it says what to change"
    assert worker.lease() is None, "no lease sends a job where it cannot fit"

    lora = submit(client, user, lora_rank=8, dtype="float32").json()["id"]  # the base and a small adapter fit
    assert wait_reason(client, user, lora)["code"] == "ready"
    leased = worker.lease()
    assert leased is not None and leased["job_id"] == lora
    assert wait_reason(client, user, full)["code"] == "too_little_memory", "the LoRA job going first changes nothing for it"

    sharded = submit(client, user, gpus=2, lora_rank=0, dtype="float32").json()["id"]  # half the state on each of two slots
    assert static_estimate(shape, lora_rank=0, dtype="float32", ranks=2, device="cpu").per_rank < 1.35 * GiB
    assert wait_reason(client, user, sharded)["code"] in ("busy", "behind"), "it fits: it waits only for the slot the LoRA job holds"


def test_a_worker_that_says_nothing_is_not_checked_and_a_larger_one_takes_the_job(make_client: Any, keys: Any, shape: dict[str, Any]) -> None:
    client = make_client()
    user = keys.new("acme", "read,write")
    small = register(client, keys.worker(8), "small", 1.5, {"smol": shape})
    full = submit(client, user, lora_rank=0, dtype="float32").json()["id"]
    assert small.lease() is None
    unsized = register(client, keys.worker(8), "unsized", None, {"smol": shape})  # no memory said: its server checks at its start
    leased = unsized.lease()
    assert leased is not None and leased["job_id"] == full

    other = submit(client, user, lora_rank=0, dtype="float32").json()["id"]
    assert small.lease() is None
    large = register(client, keys.worker(8), "large", 16.0, {"smol": shape})
    leased = large.lease()
    assert leased is not None and leased["job_id"] == other


def test_refuse_unplaceable_refuses_a_job_no_worker_has_the_memory_for(make_client: Any, keys: Any, shape: dict[str, Any]) -> None:
    client = make_client(refuse_unplaceable=True)
    user = keys.new("acme", "read,write")
    register(client, keys.worker(8), "small", 1.5, {"smol": shape})
    refused = submit(client, user, lora_rank=0, dtype="float32")
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "no worker offering smol has devices with the memory it needs" in message and "per device" in message
    assert submit(client, user, lora_rank=8).status_code == 201
    assert submit(client, user, gpus=2, lora_rank=0, dtype="float32").status_code == 201, "sharded over both slots it fits"


def test_registration_refuses_shapes_of_models_it_does_not_offer_and_nonsense_memory(make_client: Any, keys: Any, shape: dict[str, Any]) -> None:
    client = make_client()
    key = keys.worker(8)
    base = {"name": "w", "host": "127.0.0.1", "models": ["smol"], "devices": [{"index": 0, "kind": "slot"}]}
    for body in ({**base, "model_shapes": {"other": shape}},
                 {**base, "model_shapes": {"smol": {**shape, "params": -1}}},
                 {**base, "model_shapes": {"smol": {k: v for k, v in shape.items() if k != "layers"}}},
                 {**base, "devices": [{"index": 0, "kind": "slot", "memory_gb": 0}]},
                 {**base, "devices": [{"index": 0, "kind": "slot", "memory_gb": 1e9}]}):
        response = client.post("/v1/workers", json=body, headers=kit.auth(key))
        assert response.status_code == 400 and "malformed request" in response.text, (body, response.text)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_worker_with_device_memory_registers_it_and_its_models_shapes(db_url: str, keys: Any, tmp_path: Any) -> None:
    """A real ``tinkergym worker --device-memory-gb``: it counts the tiny model's shape (full fine-tuning keeps about
    2.4 MiB of it, LoRA 0.8 MiB) and registers 2 MiB a slot; the full job waits for memory, the LoRA job is leased."""
    from testkit import wait_until  # registered by tests/conftest.py
    from tinkergym.client import SchedulerClient

    server = kit.serve_scheduler(db_url, tmp_path / "data")
    owner = SchedulerClient(server.url, keys.new("acme", "read,write"))
    worker = kit.WorkerProcess(server.url, keys.new("acme", "worker"), tmp_path / "w", "w", "--device-memory-gb", "0.002")
    try:
        full = owner.submit("train", {"model": "tiny", "lora_rank": 0, "dtype": "float32"})["id"]
        why = wait_until("the worker's memory to be known", lambda: (r := owner.show(full).get("wait_reason") or {}).get("code") == "too_little_memory" and r,
                         120)
        assert "needs about 2.4 MiB per device" in why["message"] and "a device has 2.05 MiB" in why["message"], why
        lora = owner.submit("train", {"model": "tiny", "lora_rank": 8, "dtype": "float32"})["id"]
        wait_until("the LoRA job to be leased", lambda: owner.show(lora)["state"] != "queued", 120)
        assert owner.show(full)["state"] == "queued"
        owner.cancel(lora)
    finally:
        worker.stop()
        server.stop()
