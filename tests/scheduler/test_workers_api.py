"""The worker routes: registration, ownership, heartbeats, fenced state, event and checkpoint reports."""

from __future__ import annotations

from typing import Any

import pytest
import workerkit as kit  # registered by conftest.py

from tinkergym.scheduler import leases

auth, register, submit, job_row, allocated, query = kit.auth, kit.register, kit.submit, kit.job_row, kit.allocated, kit.query


@pytest.fixture
def env(make_client: Any, keys: Any) -> Any:
    clock = kit.Clock()

    class Env:
        client = make_client(clock=clock)
        user = keys.new("acme", "read,write")
        worker = keys.new("ops", "worker")

    Env.clock = clock
    return Env()


def leased(env: Any, gpus: int = 1) -> tuple[Any, str, dict[str, Any]]:
    """A worker holding a freshly granted job: (worker, job id, lease)."""
    w = register(env.client, env.worker, devices=max(gpus, 1))
    job_id = submit(env.client, env.user) if gpus == 1 else kit.multi_device_job(env.client.app, gpus)
    lease = w.lease()
    assert lease is not None and lease["job_id"] == job_id
    return w, job_id, lease


def events(env: Any, job_id: str) -> list[dict[str, Any]]:
    return env.client.get(f"/v1/jobs/{job_id}/events", headers=auth(env.user)).json()["events"]


# ----- registration -----------------------------------------------------------------------------------
def test_registration_is_idempotent_and_upserts_devices(env: Any, db_url: str) -> None:
    first = register(env.client, env.worker, name="gpu-box", devices=2, models=("tiny",))
    again = register(env.client, env.worker, name="gpu-box", devices=2, models=("tiny",))
    assert again.id == first.id
    assert query(db_url, "SELECT COUNT(*) FROM workers") == [(1,)]
    assert query(db_url, "SELECT COUNT(*) FROM devices") == [(2,)]
    # Re-registering with another layout: device 1 is gone (inactive), 2 is new, 0 is updated in place.
    body = {"name": "gpu-box", "host": "10.0.0.5", "models": ["tiny", "big"],
            "devices": [{"index": 0, "kind": "gpu", "name": "H100"}, {"index": 2, "kind": "gpu", "name": "H100"}]}
    response = env.client.post("/v1/workers", json=body, headers=auth(env.worker))
    assert response.status_code == 200 and response.json()["id"] == first.id
    view = response.json()
    assert view["host"] == "10.0.0.5" and view["models"] == ["big", "tiny"]
    assert [(d["index"], d["kind"], d["active"], d["busy"]) for d in view["devices"]] == [
        (0, "gpu", True, False), (1, "slot", False, False), (2, "gpu", True, False)]
    assert query(db_url, "SELECT COUNT(*) FROM devices") == [(3,)]
    # Another key registering the same name is another worker.
    other = register(env.client, kit_key(env, "worker"), name="gpu-box", devices=1)
    assert other.id != first.id


def kit_key(env: Any, scopes: str, tenant: str = "ops") -> str:
    """A tenant's key with ``scopes``, or (``"worker"``) a worker credential for 64 devices serving every tenant."""
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.credentials import WorkerBounds, create_worker_key

    engine = env.client.app.state.engine
    if scopes == "worker":
        return create_worker_key(engine, WorkerBounds(64))[1]
    return create_key(engine, tenant, scopes.split(","))[1]


def test_inactive_devices_are_not_granted(env: Any) -> None:
    w = register(env.client, env.worker, devices=2)
    body = {**w.body, "devices": w.body["devices"][:1]}
    assert env.client.post("/v1/workers", json=body, headers=auth(env.worker)).status_code == 200
    kit.multi_device_job(env.client.app, gpus=2)
    assert w.lease() is None


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"name": "../x", "host": "h", "devices": [{"index": 0, "kind": "gpu"}], "models": []},
    {"name": "w", "host": "h", "devices": [{"index": 0, "kind": "gpu"}, {"index": 0, "kind": "gpu"}], "models": []},
    {"name": "w", "host": "h", "devices": [{"index": 0, "kind": "tpu"}], "models": []},
    {"name": "w", "host": "h", "devices": [], "models": []},
    {"name": "w", "host": "h", "devices": [{"index": 0, "kind": "gpu"}], "models": ["/etc/passwd"]},
    {"name": "w", "host": "h/../x", "devices": [{"index": 0, "kind": "gpu"}], "models": []},
])
def test_registration_refuses_malformed_bodies(env: Any, body: dict[str, Any]) -> None:
    assert env.client.post("/v1/workers", json=body, headers=auth(env.worker)).status_code == 400


def test_worker_routes_need_the_worker_scope_and_the_registering_key(env: Any) -> None:
    w, job_id, lease = leased(env)
    assert env.client.post("/v1/workers", json=w.body, headers=auth(env.user)).status_code == 403
    assert env.client.post(f"/v1/workers/{w.id}/lease", headers=auth(env.user)).status_code == 403
    assert env.client.post(f"/v1/workers/{w.id}/lease").status_code == 401
    stranger = kit.Worker(env.client, kit_key(env, "worker"), w.id)
    assert stranger.post("/lease").status_code == 404
    assert stranger.heartbeat(job_id, lease["epoch"]).status_code == 404
    assert env.client.get("/v1/workers", headers=auth(env.worker)).status_code == 403
    assert env.client.get("/v1/workers", headers=auth(kit_key(env, "write"))).status_code == 403
    listing = env.client.get("/v1/workers", headers=auth(kit_key(env, "read")))
    assert listing.status_code == 200 and [x["id"] for x in listing.json()["workers"]] == [w.id]
    assert listing.json()["workers"][0]["devices"][0]["busy"] is True


def test_a_job_held_by_another_worker_is_409(env: Any) -> None:
    w, job_id, lease = leased(env)
    other = register(env.client, env.worker, name="w2", devices=1)
    assert other.heartbeat(job_id, lease["epoch"]).status_code == 409
    assert other.state(job_id, lease["epoch"], "starting").status_code == 409
    assert w.heartbeat(job_id, lease["epoch"]).status_code == 200


# ----- the life of a lease ------------------------------------------------------------------------------
def test_state_reports_run_a_job_to_its_end_and_free_its_devices(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env, gpus=1)
    epoch = lease["epoch"]
    assert w.state(job_id, epoch, "running", server_url="http://127.0.0.1:1").status_code == 409  # leased -> running skips starting
    assert w.state(job_id, epoch, "starting").json() == {"job_id": job_id, "epoch": epoch, "state": "starting"}
    assert w.state(job_id, epoch, "starting").status_code == 200  # a retried report
    assert w.state(job_id, epoch, "running").status_code == 400  # needs server_url
    assert w.state(job_id, epoch, "running", server_url="file:///etc").status_code == 400
    assert w.state(job_id, epoch, "running", server_url="http://127.0.0.1:8123").status_code == 200
    shown = env.client.get(f"/v1/jobs/{job_id}", headers=auth(env.user)).json()
    assert shown["state"] == "running" and shown["server_url"] == "http://127.0.0.1:8123"
    assert w.state(job_id, epoch, "queued").status_code == 400
    assert w.state(job_id, epoch, "succeeded").status_code == 200
    row = job_row(db_url, job_id)
    assert row["state"] == "succeeded" and row["lease_expires_at"] is None and row["server_token_digest"] is None
    assert allocated(db_url) == []
    assert w.heartbeat(job_id, epoch).status_code == 409  # ended: nothing to renew
    states_seen = [e["data"]["state"] for e in events(env, job_id) if e["type"] == "state"]
    assert states_seen == ["queued", "leased", "starting", "running", "succeeded"]


def test_a_clients_completion_says_why_the_job_ended_to_its_tenant_alone(env: Any, keys: Any, db_url: str) -> None:
    """The reason a client gives when it completes its job (the Tinker front door: its session ended, and why) is the job's
    end_reason; another tenant can neither complete the job nor read it, and a reason past 500 characters is refused."""
    w, job_id, lease = leased(env)
    assert w.state(job_id, lease["epoch"], "starting").status_code == 200
    assert w.state(job_id, lease["epoch"], "running", server_url="http://127.0.0.1:8123").status_code == 200
    assert env.client.get(f"/v1/jobs/{job_id}", headers=auth(env.user)).json()["end_reason"] is None  # running: no end yet
    complete, why = f"/v1/jobs/{job_id}/complete", "its Tinker session ended: no heartbeat from the client for 180 s"
    other = keys.new("other", "read,write")
    assert env.client.post(complete, json={"epoch": lease["epoch"], "reason": why}, headers=auth(other)).status_code == 404
    assert env.client.post(complete, json={"epoch": lease["epoch"], "reason": "x" * 501}, headers=auth(env.user)).status_code == 400
    assert env.client.post(complete, json={"epoch": lease["epoch"], "reason": why}, headers=auth(env.user)).json()["state"] == "succeeded"
    shown = env.client.get(f"/v1/jobs/{job_id}", headers=auth(env.user)).json()
    assert shown["state"] == "succeeded" and shown["end_reason"] == why and allocated(db_url) == []
    assert events(env, job_id)[-1]["data"] == {"state": "succeeded", "attempt": 0, "by": "client", "epoch": lease["epoch"], "reason": why}
    assert env.client.get(f"/v1/jobs/{job_id}", headers=auth(other)).status_code == 404


def test_failed_report_keeps_the_error(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env)
    assert w.state(job_id, lease["epoch"], "failed", error="CUDA out of memory").status_code == 200
    assert job_row(db_url, job_id)["error"] == "CUDA out of memory" and allocated(db_url) == []


def test_cancel_flow_heartbeat_tells_the_worker(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env)
    assert w.heartbeat(job_id, lease["epoch"]).json()["cancelling"] is False
    env.client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(env.user))
    beat = w.heartbeat(job_id, lease["epoch"]).json()
    assert beat["cancelling"] is True and beat["state"] == "cancelling"
    assert w.state(job_id, lease["epoch"], "running", server_url="http://h:1").status_code == 409
    assert w.state(job_id, lease["epoch"], "cancelled").status_code == 200
    assert job_row(db_url, job_id)["state"] == "cancelled" and allocated(db_url) == []


def test_heartbeat_renews_and_updates_last_seen(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env)
    env.clock.advance(10.0)
    beat = w.heartbeat(job_id, lease["epoch"])
    assert beat.status_code == 200
    assert beat.json()["expires_at"] == pytest.approx(env.clock() + 30.0)
    assert job_row(db_url, job_id)["lease_expires_at"] == pytest.approx(env.clock() + 30.0)
    assert query(db_url, "SELECT last_seen_at FROM workers WHERE id = :i", i=w.id)[0][0] == pytest.approx(env.clock())


def test_every_write_with_a_stale_epoch_is_409(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env)
    stale = lease["epoch"]
    env.clock.advance(31.0)
    assert leases.sweep(env.client.app) == 1
    again = w.lease()
    assert again["epoch"] == stale + 1
    for response in (
        w.heartbeat(job_id, stale),
        w.state(job_id, stale, "starting"),
        w.post(f"/jobs/{job_id}/events", {"epoch": stale, "type": "log", "data": {"line": "late"}}),
        w.post(f"/jobs/{job_id}/checkpoints", {"epoch": stale, "step": 5, "name": "step-5"}),
        w.heartbeat(job_id, stale + 7),  # an epoch from the future is as wrong
    ):
        assert response.status_code == 409, response.text
        assert response.json()["error"]["type"] == "conflict"
    assert job_row(db_url, job_id)["state"] == "leased"  # nothing the stale writer sent took effect
    assert query(db_url, "SELECT COUNT(*) FROM checkpoints") == [(0,)]
    assert all(e["data"].get("line") != "late" for e in events(env, job_id))
    assert w.heartbeat(job_id, again["epoch"]).status_code == 200


def test_events_are_appended_fenced_and_typed(env: Any) -> None:
    w, job_id, lease = leased(env)
    sent = w.post(f"/jobs/{job_id}/events", {"epoch": lease["epoch"], "type": "metrics", "data": {"step": 1, "reward": 0.5}})
    assert sent.status_code == 200
    last = events(env, job_id)[-1]
    assert last["seq"] == sent.json()["seq"] and last["type"] == "metrics" and last["data"] == {"step": 1, "reward": 0.5}
    assert w.post(f"/jobs/{job_id}/events", {"epoch": lease["epoch"], "type": "state", "data": {}}).status_code == 400
    assert w.post(f"/jobs/{job_id}/events", {"epoch": lease["epoch"], "type": "log", "data": "x"}).status_code == 400


def test_event_with_idempotency_key_is_appended_once(env: Any) -> None:
    w, job_id, lease = leased(env)
    body = {"epoch": lease["epoch"], "type": "log", "data": {"line": "hello"}}
    first = w.post(f"/jobs/{job_id}/events", body, headers={"Idempotency-Key": "ev-1"})
    second = w.post(f"/jobs/{job_id}/events", body, headers={"Idempotency-Key": "ev-1"})
    assert first.json() == second.json() and second.headers.get("Idempotent-Replayed") == "true"
    assert sum(1 for e in events(env, job_id) if e["data"].get("line") == "hello") == 1
    other = w.post(f"/jobs/{job_id}/events", {**body, "data": {"line": "bye"}}, headers={"Idempotency-Key": "ev-1"})
    assert other.status_code == 422


def test_checkpoints_are_validated_recorded_and_offered_to_the_next_lease(env: Any, db_url: str) -> None:
    w, job_id, lease = leased(env)
    epoch = lease["epoch"]
    for bad in ("..", "../escape", "a/b", "", ".hidden", "x" * 300):
        assert w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 1, "name": bad}).status_code == 400, bad
    ok = w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 10, "name": "step-10"})
    assert ok.status_code == 200 and ok.json() == {"job_id": job_id, "step": 10, "name": "step-10", "epoch": epoch}
    assert w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 10, "name": "step-10"}).status_code == 200  # retried
    assert w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 11, "name": "step-10"}).status_code == 409
    assert w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 20, "name": "step-20"}).status_code == 200
    listed = env.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(env.user)).json()["checkpoints"]
    assert [(c["step"], c["name"]) for c in listed] == [(10, "step-10"), (20, "step-20")]
    env.clock.advance(31.0)
    leases.sweep(env.client.app)
    again = w.lease()
    assert again["checkpoint"] == {"step": 20, "name": "step-20"} and again["attempt"] == 1


def test_lease_with_idempotency_key_replays_the_same_lease(env: Any, db_url: str) -> None:
    w = register(env.client, env.worker, devices=2)
    first_job = submit(env.client, env.user)
    env.clock.advance(1.0)
    submit(env.client, env.user)
    one = w.post("/lease", headers={"Idempotency-Key": "poll-1"})
    two = w.post("/lease", headers={"Idempotency-Key": "poll-1"})
    assert one.status_code == two.status_code == 200 and two.headers.get("Idempotent-Replayed") == "true"
    assert one.json() == two.json() and one.json()["lease"]["job_id"] == first_job
    assert one.json()["lease"]["token"].startswith("tgs_")
    assert query(db_url, "SELECT COUNT(*) FROM jobs WHERE state = 'leased'") == [(1,)]
    stored = repr(query(db_url, "SELECT response FROM idempotency"))
    assert one.json()["lease"]["token"] not in stored  # the token is derived again, never stored
    assert w.post("/lease", headers={"Idempotency-Key": "poll-2"}).json()["lease"]["job_id"] != first_job


def test_openapi_documents_the_worker_routes(env: Any) -> None:
    paths = env.client.app.openapi()["paths"]
    for path in ("/v1/workers", "/v1/workers/{worker_id}/lease", "/v1/workers/{worker_id}/jobs/{job_id}/heartbeat",
                 "/v1/workers/{worker_id}/jobs/{job_id}/state", "/v1/workers/{worker_id}/jobs/{job_id}/events",
                 "/v1/workers/{worker_id}/jobs/{job_id}/checkpoints"):
        assert "post" in paths[path], path


# ----- integers past the database's columns ---------------------------------------------------------------
@pytest.mark.parametrize("value", [2**31, 2**63, 2**64 + 1])
def test_integers_past_an_integer_column_are_400_on_every_route_that_stores_them(env: Any, value: int) -> None:
    """An epoch or step beyond what an INTEGER column holds (2**63 gave a 500 on SQLite, anything over 2**31 - 1 on
    PostgreSQL) is refused at the edge, and the lease and the job are untouched."""
    w, job_id, lease = leased(env)
    epoch = lease["epoch"]
    answers = {
        "heartbeat": w.heartbeat(job_id, value),
        "state": w.state(job_id, value, "starting"),
        "event": w.post(f"/jobs/{job_id}/events", {"epoch": value, "type": "log", "data": {"line": "x"}}),
        "checkpoint epoch": w.post(f"/jobs/{job_id}/checkpoints", {"epoch": value, "step": 1, "name": "s1"}),
        "checkpoint step": w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": value, "name": "s1"}),
        "artifact epoch": env.client.get(f"/v1/workers/{w.id}/jobs/{job_id}/checkpoints", params={"epoch": value}, headers=auth(env.worker)),
        "complete": env.client.post(f"/v1/jobs/{job_id}/complete", json={"epoch": value}, headers=auth(env.user)),
        "events after": env.client.get(f"/v1/jobs/{job_id}/events", params={"after": value}, headers=auth(env.user)),
    }
    for route, answer in answers.items():
        assert answer.status_code == 400, (route, answer.status_code, answer.text)
    assert w.heartbeat(job_id, epoch).status_code == 200
    assert w.post(f"/jobs/{job_id}/checkpoints", {"epoch": epoch, "step": 2**31 - 1, "name": "s1"}).status_code == 200  # the largest fits


def test_an_event_with_unstorable_text_is_400_and_the_event_list_still_answers(env: Any) -> None:
    import json

    w, job_id, lease = leased(env)
    for text in ("\ud800", "a\x00b"):
        body = json.dumps({"epoch": lease["epoch"], "type": "log", "data": {"line": text}}).encode()
        answer = env.client.post(f"/v1/workers/{w.id}/jobs/{job_id}/events", content=body,
                                 headers={**auth(env.worker), "Content-Type": "application/json"})
        assert answer.status_code == 400, answer.text
    assert env.client.get(f"/v1/jobs/{job_id}/events", headers=auth(env.user)).status_code == 200
    assert w.heartbeat(job_id, lease["epoch"]).status_code == 200  # the lease is untouched


def test_a_worker_gives_back_a_job_it_cannot_run(env: Any, db_url: str) -> None:
    """Release: the job is queued again at the same attempt with its devices free, its events name the worker and the reason,
    and the worker is quarantined with that reason (403 on its next lease request) until the operator releases it."""
    w, job_id, lease = leased(env)
    epoch = lease["epoch"]
    assert w.state(job_id, epoch, "starting").status_code == 200
    reason = "the job's server exited with code 69 while starting: No module named 'uvicorn'"
    assert w.post(f"/jobs/{job_id}/release", {"epoch": epoch, "reason": ""}).status_code == 400
    assert w.post(f"/jobs/{job_id}/release", {"epoch": epoch + 1, "reason": reason}).status_code == 409
    answer = w.post(f"/jobs/{job_id}/release", {"epoch": epoch, "reason": reason})
    assert answer.status_code == 200 and answer.json() == {"job_id": job_id, "epoch": epoch, "state": "queued"}
    row = job_row(db_url, job_id)
    assert (row["state"], row["attempt"], row["worker_id"], row["lease_expires_at"]) == ("queued", 0, None, None)
    assert allocated(db_url) == []
    named = [e["data"] for e in events(env, job_id) if e["type"] == "log" and e["data"].get("worker") == w.id]
    assert len(named) == 1 and named[0]["reason"] == reason
    refused = w.post("/lease")
    assert refused.status_code == 403 and "No module named 'uvicorn'" in refused.json()["error"]["message"]
    assert w.post(f"/jobs/{job_id}/release", {"epoch": epoch, "reason": reason}).status_code in (200, 409)  # a retry changes nothing
    assert job_row(db_url, job_id)["attempt"] == 0
    listing = env.client.get("/v1/workers", headers=auth(kit_key(env, "read"))).json()["workers"]
    assert [(x["quarantined"], x["quarantine_reason"]) for x in listing if x["id"] == w.id] == [(True, None)], "the reason names a job"

    other = register(env.client, env.worker, name="w2", devices=1)
    again = other.lease()
    assert again["job_id"] == job_id and again["epoch"] == epoch + 1 and again["attempt"] == 0
    assert leases.release_worker(env.client.app.state.store, w.id)
    assert query(db_url, "SELECT quarantined_at, quarantine_reason FROM workers WHERE id = :i", i=w.id) == [(None, None)]
