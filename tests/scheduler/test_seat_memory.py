"""Seats placed by measured memory: a seat job's heartbeat carries its shared server's memory, the scheduler keeps it on
the device's seats and learns what such jobs really keep, and a free seat takes a job only where the measure leaves room
for it (tinkergym.scheduler.memory.seat_refusal); otherwise the job waits with ``memory_held`` and the figures, and
starts once the server measures room again. Grants between two measures count the jobs they placed."""

from __future__ import annotations

from typing import Any

import pytest

import workerkit as kit  # registered by conftest.py
from tinkergym.backends.torch.sizing import seat_estimate
from tinkergym.scheduler import memory

GiB = 2**30
#: A rank-8 float32 job with the train defaults (micro-batch 8; 4 turns of 64 new tokens: 768 tokens priced).
JOB = {"model": "smol", "lora_rank": 8, "dtype": "float32"}


@pytest.fixture(scope="module")
def shape() -> dict[str, Any]:
    return kit.smollm2_shape()


def register(client: Any, key: str, shape: dict[str, Any], *, name: str = "w1", memory_gb: float = 24.0, whole: int = 0,
             shared: bool = True) -> kit.Worker:
    """A worker offering smol with ``whole`` whole slots and (``shared``) one shared slot of 4 seats after them, of ``memory_gb`` each."""
    devices = [{"index": i, "kind": "slot", "memory_gb": memory_gb} for i in range(whole)]
    if shared:
        devices.append({"index": whole, "kind": "slot", "memory_gb": memory_gb,
                        "shared": {"seats": 4, "model": "smol", "dtype": "float32", "max_lora_rank": 16}})
    body = {"name": name, "host": "127.0.0.1", "models": ["smol"], "model_shapes": {"smol": shape}, "devices": devices}
    response = client.post("/v1/workers", json=body, headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return kit.Worker(client, key, response.json()["id"], body)


def submit(client: Any, key: str, **config: Any) -> str:
    response = client.post("/v1/jobs", json={"kind": "train", "config": {**JOB, **config}}, headers=kit.auth(key))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def reason(client: Any, key: str, job_id: str) -> dict[str, str]:
    return client.get(f"/v1/jobs/{job_id}", headers=kit.auth(key)).json()["wait_reason"]


def beat(worker: kit.Worker, lease: dict[str, Any], **measured: int) -> None:
    answer = worker.post(f"/jobs/{lease['job_id']}/heartbeat", {"epoch": lease["epoch"], "memory": measured})
    assert answer.status_code == 200, answer.text


def test_the_seat_price_and_the_learned_factor(shape: dict[str, Any]) -> None:
    kept, activations = seat_estimate(shape, lora_rank=8, dtype="float32", device="cpu", micro_batch_size=8, max_seq_len=768)
    assert memory.seat_parts(JOB, shape, "slot") == (kept, activations)
    adapter = 8 * shape["lora_io"]
    assert kept == 16 * adapter, "float32: the adapter, its gradients and AdamW's two moments"
    assert seat_estimate(shape, lora_rank=16, dtype="float32", device="cpu", micro_batch_size=8, max_seq_len=768)[0] == 2 * kept
    assert memory.seat_parts({**JOB, "micro_batch_size": 16}, shape, "slot")[1] > activations  # type: ignore[index]
    assert memory.seat_parts({**JOB, "lora_rank": "x"}, shape, "slot") is None and memory.seat_parts(JOB, None, "slot") is None
    # the factor: the mean of the first measures, then a moving one; each measure bounded
    assert memory.learned_factor(1.0, 0, 3 * kept, kept) == (3.0, 1)
    assert memory.learned_factor(3.0, 1, kept, kept) == (2.0, 2)
    assert memory.learned_factor(1.0, 0, 1000 * kept, kept) == (memory.FACTOR_BOUNDS[1], 1)
    assert memory.learned_factor(1.0, 5, 0, kept) is None and memory.learned_factor(1.0, 5, kept, 0) is None
    # the rule: the larger of the peak and now + the job's activations, plus what it keeps, within the headroom
    assert activations > 8 * GiB, "SmolLM2's 8 rows of 768 tokens in float32: the logits and every layer's saved activations"
    room = memory.SharedMemory(total=24 * GiB, used=GiB, peak=2 * GiB)
    assert memory.seat_refusal(JOB, shape, room, 1.0, "slot") is None
    assert memory.seat_refusal(JOB, shape, memory.SharedMemory(total=12 * GiB, used=GiB, peak=2 * GiB), 1.0, "slot"), "its activations do not fit"
    full = memory.SharedMemory(total=24 * GiB, used=GiB, peak=int(24 * GiB * memory.HEADROOM) - kept // 2)
    assert memory.seat_refusal(JOB, shape, full, 0.5, "slot") is None, "half its price fits"
    why = memory.seat_refusal(JOB, shape, full, 1.0, "slot", where=" on device 0 of worker w")
    assert why is not None and "on device 0 of worker w" in why and "21.60 GiB" in why and "x 1.00" in why
    roomy = memory.SharedMemory(total=24 * GiB, used=GiB, peak=int(24 * GiB * memory.HEADROOM) - 3 * kept // 2)
    assert memory.seat_refusal(JOB, shape, roomy, 1.0, "slot") is None
    league = memory.seat_refusal({**JOB, "players": 2}, shape, roomy, 1.0, "slot")
    assert league is not None and "2 adapters" in league, "a league keeps an adapter a player"
    assert memory.seat_refusal(JOB, shape, memory.SharedMemory(total=24 * GiB, used=None, peak=None), 1.0, "slot") is None, "not measured: not checked"


def test_seats_take_jobs_by_the_memory_their_server_measures(make_client: Any, keys: Any, shape: dict[str, Any], db_url: str) -> None:
    client = make_client()
    user = keys.new("acme", "read,write")
    worker = register(client, keys.worker(8, kind="slot"), shape)
    kept, activations = memory.seat_parts(JOB, shape, "slot")  # type: ignore[misc]
    usable, base = int(24 * GiB * memory.HEADROOM), GiB

    first = worker.lease() if submit(client, user) else None
    assert first is not None and first["seat"] is not None
    second = submit(client, user)
    assert reason(client, user, second)["code"] == "ready", "no measure yet: the seats' count alone places it"

    # The server measures: the first job kept twice its price (factor 2), and a pass peaked within half a price of the end.
    beat(worker, first, device_bytes=base + 2 * kept, device_peak_bytes=usable - kept // 2, host_bytes=base + 2 * kept,
         host_peak_bytes=usable - kept // 2, base_bytes=base, sessions=1)
    assert kit.query(db_url, "SELECT factor, samples FROM memory_factors WHERE model = 'smol' AND worker_id = :w", w=worker.id) == [(2.0, 1)]
    why = reason(client, user, second)
    assert why["code"] == "memory_held" and "x 2.00" in why["message"] and f"{usable / GiB:.2f} GiB" in why["message"], why
    assert worker.lease() is None, "a free seat, but not the memory: no lease"
    seats = [d for d in client.get("/v1/workers", headers=kit.auth(user)).json()["workers"][0]["devices"] if d["seat_of"] is not None]
    assert {(d["used_bytes"], d["peak_bytes"]) for d in seats} == {(base + 2 * kept, usable - kept // 2)}, "every seat shows its device's measure"

    # A job left and the server's peak started again: room for exactly one more job (2 x its price, its activations within the peak).
    peak = usable - 2 * kept - kept // 2
    beat(worker, first, device_bytes=base + 2 * kept, device_peak_bytes=peak, base_bytes=base, sessions=1)
    assert reason(client, user, second)["code"] == "ready"
    granted = worker.lease()
    assert granted is not None and granted["job_id"] == second and granted["seat"] is not None
    # Granted on that measure, it counts before any new one: a third job does not take the last free seats.
    third = submit(client, user)
    assert worker.lease() is None
    assert reason(client, user, third)["code"] == "memory_held"

    # Another worker's whole device takes it rather than wait for that memory (the cross-worker preference is for room).
    other = register(client, keys.worker(8, kind="slot"), shape, name="w2", memory_gb=16.0, whole=1, shared=False)
    taken = other.lease()
    assert taken is not None and taken["job_id"] == third and taken["seat"] is None
    assert kit.query(db_url, "SELECT count(*) FROM memory_factors WHERE worker_id = :w", w=other.id) == [(0,)], \
        "a worker's measures teach its own factor alone"

    # Both jobs measured together: the factor learns from the pair (their growth over their prices: 1), the memory frees.
    assert kit.query(db_url, "SELECT factor, samples FROM memory_factors WHERE model = 'smol' AND worker_id = :w", w=worker.id) == [(2.0, 2)]
    beat(worker, granted, device_bytes=base + 2 * kept, device_peak_bytes=base + 2 * kept + activations, base_bytes=base, sessions=2)
    [(factor, samples)] = kit.query(db_url, "SELECT factor, samples FROM memory_factors WHERE model = 'smol' AND worker_id = :w", w=worker.id)
    assert (factor, samples) == (pytest.approx(5 / 3), 3)
    fourth = submit(client, user)
    assert reason(client, user, fourth)["code"] == "ready"
    placed = worker.lease()
    assert placed is not None and placed["job_id"] == fourth and placed["seat"] is not None

    # a worker forgotten (silent, holding nothing) takes its factors with it
    from tinkergym.scheduler.worker_registry import forget_worker

    for lease in (first, granted, placed):
        for state, extra in (("starting", {}), ("running", {"server_url": "http://127.0.0.1:9"}), ("succeeded", {})):
            assert worker.state(lease["job_id"], lease["epoch"], state, **extra).status_code == 200
    assert forget_worker(client.app.state.store, worker.id, seen_before=float("inf"))
    assert kit.query(db_url, "SELECT count(*) FROM memory_factors") == [(0,)]


def test_a_heartbeats_memory_is_checked_and_optional(make_client: Any, keys: Any, shape: dict[str, Any], db_url: str) -> None:
    client = make_client()
    user = keys.new("acme", "read,write")
    worker = register(client, keys.worker(8, kind="slot"), shape)
    submit(client, user)
    lease = worker.lease()
    assert lease is not None
    for bad in ({"device_bytes": -1}, {"device_bytes": "1 GiB"}, {"sessions": 10**6}, {"device_bytes": 1, "extra": 2}):
        answer = worker.post(f"/jobs/{lease['job_id']}/heartbeat", {"epoch": lease["epoch"], "memory": bad})
        assert answer.status_code == 400 and "memory" in answer.text, (bad, answer.text)
    assert worker.heartbeat(lease["job_id"], lease["epoch"]).status_code == 200, "a heartbeat without memory renews as before"
    assert kit.query(db_url, "SELECT count(*) FROM devices WHERE used_bytes IS NOT NULL") == [(0,)]
    # a whole device's server measures its own device; the sessions of a whole server teach no factor
    whole = register(client, keys.worker(8, kind="slot"), shape, name="w3", whole=1, shared=False)
    submit(client, user, lora_rank=0)
    full = whole.lease()
    assert full is not None and full["seat"] is None
    beat(whole, full, device_bytes=3 * GiB, device_peak_bytes=3 * GiB, sessions=1, base_bytes=GiB)
    assert kit.query(db_url, "SELECT used_bytes FROM devices WHERE used_bytes IS NOT NULL") == [(3 * GiB,)]
    assert kit.query(db_url, "SELECT count(*) FROM memory_factors") == [(0,)]


def test_one_request_for_many_seats_prices_each_job_it_places(make_client: Any, keys: Any, shape: dict[str, Any]) -> None:
    client = make_client()
    user = keys.new("acme", "read,write")
    worker = register(client, keys.worker(8, kind="slot"), shape)
    kept, _ = memory.seat_parts(JOB, shape, "slot")  # type: ignore[misc]
    usable, base = int(24 * GiB * memory.HEADROOM), GiB
    submit(client, user)
    first = worker.lease()
    assert first is not None and first["seat"] is not None
    # measured: room for exactly one more job (as above), and three seats free
    beat(worker, first, device_bytes=base + 2 * kept, device_peak_bytes=usable - kept // 2, base_bytes=base, sessions=1)
    beat(worker, first, device_bytes=base + 2 * kept, device_peak_bytes=usable - 2 * kept - kept // 2, base_bytes=base, sessions=1)
    waiting = [submit(client, user) for _ in range(3)]
    answer = worker.post("/lease", {"max": 3})
    assert answer.status_code == 200, answer.text
    granted = answer.json()["leases"]
    assert [lease["job_id"] for lease in granted] == waiting[:1], "the second seat's job is priced with the first one placed"
    assert reason(client, user, waiting[1])["code"] == "memory_held"
