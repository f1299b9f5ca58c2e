"""What an operator key sees (every tenant's jobs, ``GET /v1/cluster``), what a tenant's key sees (its own, its usage beside
its quotas), the device-seconds lease renewals add up, and the job-list stream (``GET /v1/jobs/changes``) that tells a
page when to read its list again."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

import workerkit as kit  # registered by conftest.py
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.auth import Principal, parse_scopes
from tinkergym.scheduler.bounds import WorkerBounds
from tinkergym.scheduler.retention import delete_job
from tinkergym.scheduler.usage import QUEUE_SAMPLE_S, sample_queue
from tinkergym.serve.asgi import ThreadServer
from testkit import wait_until
from workerkit import auth, submit


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_an_operator_key_reads_every_tenant_and_a_tenant_key_its_own(make_client: Any, keys: Any) -> None:
    client = make_client()
    acme, globex = keys.new("acme"), keys.new("globex")
    admin, operator = keys.new("acme", "admin"), keys.new("ops", "read,operator")
    mine, theirs = submit(client, acme, priority=1), submit(client, globex)
    later = submit(client, acme)

    listed = client.get("/v1/jobs", headers=auth(operator)).json()["jobs"]
    assert {(j["id"], j["tenant"]) for j in listed} == {(mine, "acme"), (theirs, "globex"), (later, "acme")}
    only = client.get("/v1/jobs", params={"tenant": "globex"}, headers=auth(operator)).json()["jobs"]
    assert [j["id"] for j in only] == [theirs]
    assert [j["id"] for j in client.get("/v1/jobs", headers=auth(acme)).json()["jobs"]] == [later, mine]
    refused = client.get("/v1/jobs", params={"tenant": "globex"}, headers=auth(acme))
    assert refused.status_code == 403 and "operator" in refused.json()["error"]["message"]
    assert client.get("/v1/jobs", params={"tenant": "acme"}, headers=auth(acme)).status_code == 200
    for hostile, says in (("glo%00bex", "NUL"), ("%ED%A0%80", "not a tenant name"), ("..%2Facme", "not a tenant name"), ("ACME", "not a tenant name")):
        answer = client.get(f"/v1/jobs?tenant={hostile}", headers=auth(operator))  # refused before any query
        assert answer.status_code == 400 and says in answer.json()["error"]["message"], (hostile, answer.text)

    # Queue positions in the list equal each job's own: its place in its tenant's queue (priority first, then age).
    positions = {j["id"]: j["queue_position"] for j in listed}
    assert positions == {mine: 1, theirs: 1, later: 2}
    for job_id, position in positions.items():
        assert client.get(f"/v1/jobs/{job_id}", headers=auth(operator)).json()["queue_position"] == position

    # Reads reach every tenant's job with the operator's key; a tenant's key (admin too) gets 404 for another's.
    for path in (f"/v1/jobs/{theirs}", f"/v1/jobs/{theirs}/events", f"/v1/jobs/{theirs}/checkpoints"):
        assert client.get(path, headers=auth(operator)).status_code == 200, path
        assert client.get(path, headers=auth(admin)).status_code == 404, path
    # Writes stay within the operator key's own tenant: it cannot cancel another tenant's job.
    ops_writer = keys.new("ops", "read,write,operator")
    assert client.post(f"/v1/jobs/{theirs}/cancel", headers=auth(ops_writer)).status_code == 404
    assert client.get(f"/v1/jobs/{theirs}", headers=auth(acme)).status_code == 404

    # What each key is; the cluster is an operator's alone (admin does not imply it).
    assert client.get("/v1/me", headers=auth(admin)).json() == {"key_id": admin.split("_")[1], "tenant": "acme", "scopes": ["admin"],
                                                                 "operator": False}
    assert client.get("/v1/me", headers=auth(operator)).json()["operator"] is True
    assert client.get("/v1/cluster", headers=auth(admin)).status_code == 403
    assert client.get("/v1/cluster", headers=auth(operator)).status_code == 200

    # Usage: a tenant's own row; an operator's, every tenant's.
    assert [t["tenant"] for t in client.get("/v1/usage", headers=auth(acme)).json()["tenants"]] == ["acme"]
    rows = {t["tenant"]: t for t in client.get("/v1/usage", headers=auth(operator)).json()["tenants"]}
    assert {"acme", "globex", "ops"} <= set(rows)
    assert (rows["acme"]["queued"], rows["acme"]["max_queued"], rows["globex"]["queued"]) == (2, 100, 1)


def test_operator_is_a_scope_of_its_own() -> None:
    """``operator`` is given by name only: ``admin`` does not imply it, and a worker credential never has it."""
    assert parse_scopes("read,operator") == ["operator", "read"]
    assert not Principal("k", "acme", frozenset({"admin"})).allows("operator")
    assert Principal("k", "acme", frozenset({"operator"})).allows("operator")
    assert Principal("k", "acme", frozenset({"operator"})).tenant_filter() is None
    assert Principal("k", "acme", frozenset({"admin"})).tenant_filter() == "acme"
    worker = Principal("k", "cluster", frozenset({"worker", "operator"}), bounds=WorkerBounds(devices=1))
    assert not worker.allows("operator")


def test_renewals_add_device_seconds_and_the_cluster_shows_what_each_device_holds(make_client: Any, keys: Any, clock: Clock,
                                                                                   db_url: str) -> None:
    client = make_client(clock=clock, lease_ttl_s=30.0)
    acme, operator = keys.new("acme"), keys.new("ops", "read,operator")
    worker_key = keys.worker(8)
    whole = kit.register(client, worker_key, name="w1", devices=2)
    job = submit(client, acme)
    lease = whole.lease()
    assert lease is not None and lease["job_id"] == job
    epoch = lease["epoch"]
    assert whole.state(job, epoch, "starting").status_code == 200

    clock.now += 10  # 15 s on one device, over two renewals
    assert whole.heartbeat(job, epoch).status_code == 200
    clock.now += 5
    assert whole.heartbeat(job, epoch).status_code == 200
    usage = client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]
    assert usage["device_seconds"] == pytest.approx(15.0) and usage["devices_held"] == 1 and usage["holding"] == 1
    clock.now += 100  # past the lease: a late renewal is refused and adds nothing
    assert whole.heartbeat(job, epoch).status_code == 409
    assert client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]["device_seconds"] == pytest.approx(15.0)

    # A seat counts its share of its device: 6 s on one of 3 seats is 2 device-seconds.
    shared = client.post("/v1/workers", headers=auth(worker_key), json={
        "name": "w2", "host": "127.0.0.1", "models": ["tiny"],
        "devices": [{"index": 0, "kind": "slot", "shared": {"seats": 3, "model": "tiny", "dtype": "float32", "max_lora_rank": 16}}]})
    assert shared.status_code == 200, shared.text
    seated_worker = kit.Worker(client, worker_key, shared.json()["id"], {})
    seated = client.post("/v1/jobs", headers=auth(acme), json={"kind": "train", "gpus": 1,
                                                               "config": {"model": "tiny", "dtype": "float32", "lora_rank": 8}}).json()["id"]
    seat_lease = seated_worker.lease()
    assert seat_lease is not None and seat_lease["job_id"] == seated and seat_lease.get("seat") is not None
    clock.now += 6
    assert seated_worker.heartbeat(seated, seat_lease["epoch"]).status_code == 200
    assert client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]["device_seconds"] == pytest.approx(17.0)

    # The list says which jobs hold a seat now (the expired lease still holds its device until the sweeper's pass).
    listed = {j["id"]: j["seat"] for j in client.get("/v1/jobs", headers=auth(acme)).json()["jobs"]}
    assert listed == {seated: True, job: False}
    # The cluster: each device with its holder and lease end, the leases by end, the queue, every tenant's usage.
    view = client.get("/v1/cluster", headers=auth(operator)).json()
    by_name = {w["name"]: w for w in view["workers"]}
    held = [d for d in by_name["w2"]["devices"] if d["held_by"]]
    assert len(held) == 1 and held[0]["held_by"]["job_id"] == seated and held[0]["held_by"]["tenant"] == "acme"
    assert held[0]["seat_of"] == 0 and held[0]["shared"]["model"] == "tiny"
    assert held[0]["held_by"]["lease_expires_at"] == pytest.approx(clock.now + 30.0)
    assert [e["job_id"] for e in view["ending"]] == [job, seated]  # the expired lease first (the sweeper frees it next)
    assert view["queue"]["seats_held"] == 1 and view["queue"]["seats_free"] == 2
    assert {t["tenant"]: t["device_seconds"] for t in view["tenants"]}["acme"] == pytest.approx(17.0)

    # The queue's history: a sample per QUEUE_SAMPLE_S of the app's clock.
    app = client.app
    assert sample_queue(app) and not sample_queue(app)
    clock.now += QUEUE_SAMPLE_S
    submit(client, acme)
    assert sample_queue(app)
    history = client.get("/v1/cluster", headers=auth(operator)).json()["history"]
    assert [sum(h["queued"].values()) for h in history] == [0, 1]

    # Retention keeps a deleted job's device-seconds in its tenant's total.
    assert client.post(f"/v1/jobs/{seated}/cancel", headers=auth(acme)).status_code == 200
    assert seated_worker.heartbeat(seated, seat_lease["epoch"]).json()["cancelling"] is True  # QUEUE_SAMPLE_S more on the seat
    assert seated_worker.state(seated, seat_lease["epoch"], "cancelled").status_code == 200
    spent = 17.0 + QUEUE_SAMPLE_S / 3
    assert client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]["device_seconds"] == pytest.approx(spent)
    assert delete_job(app.state.store, app.state.artifacts, seated)
    assert client.get(f"/v1/jobs/{seated}", headers=auth(acme)).status_code == 404
    assert client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]["device_seconds"] == pytest.approx(spent)


def test_heartbeats_carry_the_servers_token_counts_into_the_usage(make_client: Any, keys: Any, clock: Clock) -> None:
    """A server's totals at a lease: only growth counts (a repeated or smaller report adds nothing), a new lease's server
    counts from 0, and a malformed report is refused."""
    client = make_client(clock=clock, lease_ttl_s=30.0)
    acme = keys.new("acme")
    worker = kit.register(client, keys.worker(2), devices=1)
    job = submit(client, acme)
    first = worker.lease()
    assert first is not None

    def beat(epoch: int, trained: int, sampled: int) -> Any:
        return worker.post(f"/jobs/{job}/heartbeat", {"epoch": epoch, "usage": {"tokens_trained": trained, "tokens_sampled": sampled}})

    def tokens() -> tuple[int, int]:
        row = client.get("/v1/usage", headers=auth(acme)).json()["tenants"][0]
        return row["tokens_trained"], row["tokens_sampled"]

    assert beat(first["epoch"], 100, 40).status_code == 200
    assert tokens() == (100, 40)
    assert beat(first["epoch"], 100, 40).status_code == 200  # the same totals again: nothing more
    assert beat(first["epoch"], 90, 55).status_code == 200  # trained read lower (a stale read): only sampled grew
    assert tokens() == (100, 55)
    for bad in ({"tokens_trained": -1, "tokens_sampled": 0}, {"tokens_trained": 2**60, "tokens_sampled": 0}, {"tokens_trained": 1}):
        refused = worker.post(f"/jobs/{job}/heartbeat", {"epoch": first["epoch"], "usage": bad})
        assert refused.status_code in (400, 422), (bad, refused.text)
    assert tokens() == (100, 55)

    clock.now += 60  # the lease expires; the job's next lease starts a new server, which counts from 0
    app = client.app
    from tinkergym.scheduler.leases import sweep
    assert sweep(app) == 1
    second = worker.lease()
    assert second is not None and second["job_id"] == job and second["epoch"] > first["epoch"]
    assert beat(second["epoch"], 7, 3).status_code == 200
    assert tokens() == (107, 58)
    assert beat(first["epoch"], 500, 500).status_code == 409  # the old lease's report is fenced off
    assert tokens() == (107, 58)


class Changes:
    """A job-list stream read in a thread: the number of ``changed`` messages so far."""

    def __init__(self, url: str, key: str) -> None:
        self.count, self.ended, self.status = 0, threading.Event(), 0
        self.opened = threading.Event()
        self.client = httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=None))
        self.thread = threading.Thread(target=self._read, args=(key,), daemon=True)
        self.thread.start()
        assert self.opened.wait(10)

    def _read(self, key: str) -> None:
        try:
            with self.client.stream("GET", "/v1/jobs/changes", headers=auth(key)) as response:
                self.status = response.status_code
                self.opened.set()
                for line in response.iter_lines():
                    if line == "event: changed":
                        self.count += 1
        except httpx.HTTPError:
            pass
        finally:
            self.opened.set()
            self.ended.set()

    def settles_at(self, count: int, wait: float = 0.5) -> bool:
        """Whether the count reaches ``count`` and stays there for ``wait`` seconds."""
        wait_until(f"{count} changed messages", lambda: self.count >= count, timeout=10)
        threading.Event().wait(wait)
        return self.count == count

    def reaches(self, count: int) -> bool:
        wait_until(f"{count} changed messages", lambda: self.count >= count, timeout=10)
        return True

    def close(self) -> None:
        self.client.close()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_job_list_stream_says_when_the_keys_jobs_change(db_url: str, keys: Any, tmp_path: Any) -> None:
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sse_poll_s=0.05, changes_max_s=5.0)))
    acme, globex, operator = keys.new("acme"), keys.new("globex"), keys.new("ops", "read,operator")
    http = httpx.Client(base_url=server.url, timeout=30)
    streams: list[Changes] = []
    try:
        running = submit(http, globex)  # globex's job runs: its events do not concern acme
        worker = kit.register(http, keys.worker(4), devices=1)
        lease = worker.lease()
        assert lease is not None and lease["job_id"] == running
        mine, everyone = Changes(server.url, acme), Changes(server.url, operator)
        streams += [mine, everyone]
        assert mine.status == 200 and mine.settles_at(1) and everyone.settles_at(1)  # at once: read the list now

        ok = worker.post(f"/jobs/{running}/events", {"epoch": lease["epoch"], "type": "metrics", "data": {"step": 1, "loss": 1.0}})
        assert ok.status_code == 200, ok.text
        assert everyone.settles_at(2) and mine.count == 1  # another tenant's event: the operator's list only

        job = submit(http, acme)  # a job of its own (and the queue moved): both (and its `waiting` event may follow)
        assert mine.reaches(2) and everyone.reaches(3)
        threading.Event().wait(0.5)
        seen = mine.count
        http.post(f"/v1/jobs/{job}/client-events", headers=auth(acme), json={"type": "log", "data": {"message": "hi"}})
        assert mine.reaches(seen + 1)

        # The stream ends after changes_max_s, and a reconnection is told at once to read again.
        assert mine.ended.wait(10)
        again = Changes(server.url, acme)
        streams.append(again)
        assert again.settles_at(1, wait=0.2)
    finally:
        for stream in streams:
            stream.close()
        http.close()
        server.stop()
