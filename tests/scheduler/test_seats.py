"""Seats: LoRA jobs packed onto a worker's shared training server, one seat a job (tinkergym.scheduler.seats).

Registration (seats counted as their device in a credential's bounds), the placement rule (same base and dtype, rank
within the server's, LoRA train/sft of one device, nothing a shared base lacks), seats before whole devices, a
lease's epoch fencing its seat alone, quotas and wait reasons, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py

from tinkergym.scheduler import granting, leases
from tinkergym.scheduler.seats import SEAT_BASE, fits, packable, seat_index

SHARED = {"seats": 3, "model": "tiny", "dtype": "float32", "max_lora_rank": 16}


def register(client: Any, key: str, name: str = "w1", whole: int = 1, shared: dict[str, Any] | None = None) -> kit.Worker:
    """A worker with ``whole`` whole slots (0..) and one shared slot after them (its seats: ``shared``)."""
    devices = [{"index": i, "kind": "slot", "name": f"slot {i}"} for i in range(whole)]
    devices.append({"index": whole, "kind": "slot", "name": f"slot {whole}", "shared": shared or SHARED})
    body = {"name": name, "host": "127.0.0.1", "devices": devices, "models": ["tiny", "other"]}
    response = client.post("/v1/workers", json=body, headers=kit.auth(key))
    assert response.status_code == 200, response.text
    return kit.Worker(client, key, response.json()["id"], body)


def submit(client: Any, key: str, kind: str = "train", **config: Any) -> str:
    """A queued job of ``kind`` on model tiny with ``config``, one second after the last (the queue's order is by age)."""
    response = client.post("/v1/jobs", json={"kind": kind, "config": {"model": "tiny", **config}}, headers=kit.auth(key))
    assert response.status_code == 201, response.text
    client.app.state.store.clock.advance(1.0)
    return response.json()["id"]


@pytest.fixture
def setup(make_client: Any, keys: Any) -> Any:
    clock = kit.Clock()

    class Setup:
        client = make_client(clock=clock, lease_ttl_s=30.0)
        user = keys.new("acme", "read,write")
        other = keys.new("beta", "read,write")
        worker_key = keys.new("ops", "worker")

    Setup.clock = clock  # type: ignore[attr-defined]
    return Setup()


def test_the_placement_rule() -> None:
    assert packable("train", 1, {"model": "tiny"}) and packable("sft", 1, {"model": "tiny", "lora_rank": 4})
    assert not packable("train", 1, {"model": "tiny", "lora_rank": 0}), "full fine-tuning keeps whole devices"
    assert not packable("train", 2, {"model": "tiny"}), "a job of several devices keeps whole devices"
    assert not packable("inference", 1, {"model": "tiny"}) and not packable("eval", 1, {"model": "tiny"})
    for unsupported in ({"lora_dropout": 0.1}, {"gradient_checkpointing": True}, {"deterministic": True}):
        assert not packable("train", 1, {"model": "tiny", **unsupported}), unsupported
    assert fits(SHARED, "train", 1, '{"model": "tiny", "dtype": "float32", "lora_rank": 16}')
    assert fits(SHARED, "train", 1, {"model": "tiny"}), "dtype auto takes the server's; the default rank (8) is within 16"
    assert not fits(SHARED, "train", 1, {"model": "tiny", "lora_rank": 32})
    assert not fits(SHARED, "train", 1, {"model": "tiny", "dtype": "bfloat16"})
    assert not fits(SHARED, "train", 1, {"model": "other"})
    assert seat_index(0, 0) == SEAT_BASE and seat_index(1, 0) > seat_index(0, 63)


def test_a_shared_device_registers_as_its_seats_and_counts_once_in_the_bounds(setup: Any, keys: Any) -> None:
    key = keys.worker(2, kind="slot")
    worker = register(setup.client, key, whole=1)
    view = setup.client.get("/v1/workers", headers=kit.auth(setup.user)).json()["workers"][0]
    seats = [d for d in view["devices"] if d["seat_of"] is not None]
    assert [d["index"] for d in view["devices"] if d["seat_of"] is None] == [0]
    assert [d["index"] for d in seats] == [seat_index(1, k) for k in range(3)]
    assert all(d["seat_of"] == 1 and d["shared"] == {"model": "tiny", "dtype": "float32", "max_lora_rank": 16} for d in seats)
    # 2 devices of 2: a second worker of the same credential is refused, whatever the seats
    devices = [{"index": 0, "kind": "slot", "name": "x"}]
    refused = setup.client.post("/v1/workers", json={"name": "w2", "host": "127.0.0.1", "devices": devices, "models": ["tiny"]},
                                headers=kit.auth(key))
    assert refused.status_code == 403 and "makes 3" in refused.text
    # fewer seats on registering again: the others go inactive
    again = register(setup.client, key, whole=1, shared={**SHARED, "seats": 1})
    assert again.id == worker.id
    view = setup.client.get("/v1/workers", headers=kit.auth(setup.user)).json()["workers"][0]
    assert [d["index"] for d in view["devices"] if d["active"]] == [0, seat_index(1, 0)]
    bad = setup.client.post("/v1/workers", headers=kit.auth(key), json={
        "name": "w1", "host": "127.0.0.1", "models": ["tiny"], "devices": [{"index": 0, "kind": "slot", "shared": {**SHARED, "model": "other"}}]})
    assert bad.status_code == 400 and "one of the worker's models" in bad.text


def test_lora_jobs_take_seats_first_and_the_rest_whole_devices(setup: Any, db_url: str) -> None:
    worker = register(setup.client, setup.worker_key, whole=1)
    a = submit(setup.client, setup.user, dtype="float32", lora_rank=16)
    full = submit(setup.client, setup.user, lora_rank=0)
    b = submit(setup.client, setup.other, lora_rank=4)
    big = submit(setup.client, setup.other, lora_rank=32)
    c = submit(setup.client, setup.user, kind="sft")
    d = submit(setup.client, setup.other)
    granted = [worker.lease() for _ in range(4)]
    assert worker.lease() is None
    seat_of = {g["job_id"]: g["seat"] for g in granted}
    # seats first, in the grant order: the two tenants take turns (fair share), each in its own queue order
    assert seat_of == {a: seat_index(1, 0), b: seat_index(1, 1), full: None, d: seat_index(1, 2)}
    assert [g["job_id"] for g in granted] == [a, b, full, d]
    assert all(g["devices"] == ([1] if g["seat"] is not None else [0]) for g in granted), "a seat's device is its server's"
    # big (rank 32) never fits a seat, and c waits for one: both queued
    assert kit.job_row(db_url, big)["state"] == kit.job_row(db_url, c)["state"] == "queued"
    kit.assert_no_double_grant(db_url)
    # a seat lease's epoch fences that job alone: the other seats' jobs are untouched by its end
    lease_b = next(g for g in granted if g["job_id"] == b)
    assert worker.heartbeat(b, lease_b["epoch"] + 1).status_code == 409
    assert worker.state(b, lease_b["epoch"], "failed", error="x").status_code == 200
    assert worker.heartbeat(a, next(g for g in granted if g["job_id"] == a)["epoch"]).status_code == 200
    nxt = worker.lease()
    assert nxt is not None and nxt["job_id"] == c and nxt["seat"] == seat_index(1, 1), "the freed seat goes to the next LoRA job"
    assert kit.job_row(db_url, big)["state"] == "queued"


def test_expired_seat_leases_requeue_their_jobs_alone(setup: Any, db_url: str) -> None:
    worker = register(setup.client, setup.worker_key, whole=0)
    jobs = [submit(setup.client, k) for k in (setup.user, setup.user, setup.other)]
    granted = {g["job_id"]: g for g in (worker.lease() for _ in jobs)}
    assert set(granted) == set(jobs)
    setup.clock.advance(20)
    for job in jobs[:2]:  # two heartbeat; the third's worker went silent
        assert worker.heartbeat(job, granted[job]["epoch"]).status_code == 200
    setup.clock.advance(15)
    assert leases.sweep(setup.client.app) == 1
    assert kit.job_row(db_url, jobs[2])["state"] == "queued" and kit.job_row(db_url, jobs[2])["attempt"] == 0  # never ran: the worker's strike
    assert [kit.job_row(db_url, j)["state"] for j in jobs[:2]] == ["leased", "leased"]
    again = worker.lease()
    assert again["job_id"] == jobs[2] and again["epoch"] == granted[jobs[2]]["epoch"] + 1 and again["seat"] == granted[jobs[2]]["seat"]


def test_a_seat_counts_as_a_device_toward_the_tenants_quota(setup: Any, db_url: str) -> None:
    from sqlalchemy import update

    from tinkergym.scheduler.db import make_engine, tenants

    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(tenants).where(tenants.c.id == "acme").values(max_gpus=1))
    engine.dispose()
    worker = register(setup.client, setup.worker_key, whole=0)
    first, second = submit(setup.client, setup.user), submit(setup.client, setup.user)
    assert worker.lease()["job_id"] == first
    assert worker.lease() is None and kit.job_row(db_url, second)["state"] == "queued"
    reason = setup.client.get(f"/v1/jobs/{second}", headers=kit.auth(setup.user)).json()["wait_reason"]
    assert reason["code"] == "quota"


def test_wait_reasons_know_seats(setup: Any) -> None:
    register(setup.client, setup.worker_key, whole=0, shared={**SHARED, "seats": 1})

    def reason(job: str) -> dict[str, str]:
        return setup.client.get(f"/v1/jobs/{job}", headers=kit.auth(setup.user)).json()["wait_reason"]

    lora = submit(setup.client, setup.user)
    assert reason(lora)["code"] == "ready", "a free seat fits it"
    full = submit(setup.client, setup.user, lora_rank=0)
    found = reason(full)
    assert found["code"] == "too_few_devices" and "seats of shared servers take only LoRA" in found["message"]
    worker = kit.Worker(setup.client, setup.worker_key, setup.client.get("/v1/workers", headers=kit.auth(setup.user)).json()["workers"][0]["id"])
    assert worker.lease()["job_id"] == lora
    later = submit(setup.client, setup.user)
    assert reason(later)["code"] == "busy"


def test_a_job_resumes_on_whichever_kind_of_place_is_free_whatever_wrote_its_checkpoints(setup: Any, db_url: str) -> None:
    """A seat's job and a whole device's job lose their leases; each resumes on the other kind of place (both load each
    other's states: tinkergym.backends.torch.lora_states)."""
    worker = register(setup.client, setup.worker_key, whole=1, shared={**SHARED, "seats": 1})
    seated, whole = submit(setup.client, setup.user), submit(setup.client, setup.user)  # one tenant's: its queue order alone
    first = {g["job_id"]: g for g in (worker.lease(), worker.lease())}
    assert first[seated]["seat"] is not None and first[whole]["seat"] is None
    for job, lease in first.items():
        assert worker.state(job, lease["epoch"], "starting").status_code == 200
        assert worker.state(job, lease["epoch"], "running", server_url="http://127.0.0.1:1").status_code == 200
        answer = worker.post(f"/jobs/{job}/checkpoints", {"epoch": lease["epoch"], "step": 1, "name": "step_000001"})
        assert answer.status_code == 200, answer.text
    # both lose their leases; a new LoRA job of a higher priority takes the seat, so the seat's job takes the whole device
    setup.clock.advance(31)
    assert leases.sweep(setup.client.app) == 2
    response = setup.client.post("/v1/jobs", json={"kind": "train", "config": {"model": "tiny"}, "priority": 1}, headers=kit.auth(setup.user))
    newcomer = response.json()["id"]
    taken = {}
    while (granted := worker.lease()) is not None:
        taken[granted["job_id"]] = granted
    assert set(taken) == {newcomer, seated}
    assert taken[newcomer]["seat"] is not None and taken[seated]["seat"] is None, "the seat's job resumes on the whole device"
    reason = setup.client.get(f"/v1/jobs/{whole}", headers=kit.auth(setup.user)).json()["wait_reason"]
    assert reason["code"] == "busy", reason
    # the newcomer ends; the job whose checkpoints a whole device wrote resumes on the seat it frees
    epoch = taken[newcomer]["epoch"]
    assert worker.state(newcomer, epoch, "starting").status_code == 200
    assert worker.state(newcomer, epoch, "running", server_url="http://127.0.0.1:1").status_code == 200
    assert worker.state(newcomer, epoch, "succeeded").status_code == 200
    again = worker.lease()
    assert again is not None and again["job_id"] == whole and again["seat"] is not None


def test_a_packable_job_waits_for_a_free_seat_on_another_worker_rather_than_take_a_whole_device(setup: Any) -> None:
    """Three workers: two with whole devices only, one with a seat. The seat's worker polls last, and still gets the LoRA
    job; a full fine-tuning job takes a whole device; once the seat is held, the next LoRA job takes a whole device."""

    def whole_only(name: str) -> kit.Worker:
        body = {"name": name, "host": "127.0.0.1", "devices": [{"index": 0, "kind": "slot", "name": "slot 0"}], "models": ["tiny"]}
        response = setup.client.post("/v1/workers", json=body, headers=kit.auth(setup.worker_key))
        assert response.status_code == 200, response.text
        return kit.Worker(setup.client, setup.worker_key, response.json()["id"], body)

    first, second = whole_only("w1"), whole_only("w2")
    seated = register(setup.client, setup.worker_key, name="w3", whole=0, shared={**SHARED, "seats": 1})
    lora = submit(setup.client, setup.user)
    assert first.lease() is None and second.lease() is None, "a whole device went to a job that a free seat elsewhere fits"
    granted = seated.lease()
    assert granted["job_id"] == lora and granted["seat"] is not None
    full = submit(setup.client, setup.user, lora_rank=0)
    assert first.lease()["job_id"] == full
    later = submit(setup.client, setup.user)  # no seat is free now
    assert second.lease()["job_id"] == later
    # a free seat of a worker gone silent (past the worker timeout) is not waited for
    for worker, job in ((seated, lora), (first, full), (second, later)):
        epoch = granted["epoch"] if job == lora else 1
        for state in ("starting", "running", "succeeded"):
            extra = {"server_url": "http://127.0.0.1:1"} if state == "running" else {}
            assert worker.state(job, epoch, state, **extra).status_code == 200
    setup.clock.advance(3 * 30 + 1)
    first.lease()  # back from silence itself: nothing is queued
    waiting = submit(setup.client, setup.user)
    assert first.lease()["job_id"] == waiting


def test_a_league_takes_its_players_seats_of_one_server_and_counts_as_one_job(setup: Any, db_url: str) -> None:
    """A league job (``players``: N adapters trained together) takes N seats of one shared server in one lease, never a
    whole device; against its tenant's quota it is one job; a league larger than any server's seats is told so."""
    from sqlalchemy import update

    from tinkergym.scheduler.db import make_engine, tenants

    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(tenants).where(tenants.c.id == "acme").values(max_gpus=2))
    engine.dispose()
    worker = register(setup.client, setup.worker_key, whole=1)

    def reason(job: str) -> dict[str, str]:
        return setup.client.get(f"/v1/jobs/{job}", headers=kit.auth(setup.user)).json()["wait_reason"]

    for body in ({"kind": "train", "config": {"model": "tiny", "players": 2}}, {"kind": "sft", "config": {"model": "tiny", "trainer": "league", "players": 2}},
                 {"kind": "train", "gpus": 2, "config": {"model": "tiny", "trainer": "league", "players": 2}}):
        refused = setup.client.post("/v1/jobs", json=body, headers=kit.auth(setup.user))
        assert refused.status_code in (400, 422) and "players is a league" in refused.text, body
    too_big = submit(setup.client, setup.user, trainer="league", players=4)
    found = reason(too_big)
    assert found["code"] == "too_few_devices" and "a league of 4 players takes 4 seats of one shared server" in found["message"]
    assert "the largest such server has 3" in found["message"]
    league = submit(setup.client, setup.user, trainer="league", players=2)
    assert reason(league)["code"] == "ready"
    lone = submit(setup.client, setup.user)
    after = submit(setup.client, setup.user, trainer="league", players=2)
    granted = worker.lease()
    assert granted["job_id"] == league and granted["seats"] == [seat_index(1, 0), seat_index(1, 1)] and granted["devices"] == [1]
    assert granted["seat"] == seat_index(1, 0)
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert granting.held_by_tenant(conn, "acme") == 1, "the league's two seats are one job toward max_gpus"
    engine.dispose()
    nxt = worker.lease()  # the lone job takes the third seat (the whole device stays for jobs no seat fits)
    assert nxt["job_id"] == lone and nxt["seat"] == seat_index(1, 2) and nxt["seats"] == [seat_index(1, 2)]
    assert worker.lease() is None, "the second league needs two seats of one server and the quota's room: it waits"
    assert kit.job_row(db_url, after)["state"] == "queued" and reason(after)["code"] == "quota"
    assert worker.state(league, granted["epoch"], "failed", error="x").status_code == 200
    third = worker.lease()
    assert third["job_id"] == after and sorted(third["seats"]) == [seat_index(1, 0), seat_index(1, 1)]
    kit.assert_no_double_grant(db_url)
