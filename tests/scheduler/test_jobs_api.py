"""The job API: the auth matrix walked from the app's own route table, tenants, Idempotency-Key (100 parallel
submissions against a live server), cursor pages, body limits, quotas, cancel, config checks, the OpenAPI document."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sqlalchemy import func, select
from tinkergym.serve.asgi import ThreadServer
from tinkergym.scheduler.app import PUBLIC_PATHS, SchedulerSettings, create_app
from tinkergym.scheduler.auth import SCOPES, ensure_tenant, revoke_key
from tinkergym.scheduler.db import idempotency, jobs, make_engine

CONFIG = {"model": "smollm2-135m", "env": "tinker/Bandit-v0", "steps": 3}
#: Routes any valid key may call, whatever its scopes. Everything else must refuse at least one scope, so a route
#: added without a scope check fails the matrix. The OpenAPI document describes the API to every client (a
#: worker key needs it as much as a read key), and it still needs a key: it is not public.
ANY_SCOPE_ROUTES = {("GET", "/openapi.json")}
#: The scope each job route needs (admin holds every scope); routes of other modules are only checked generically.
JOB_ROUTE_SCOPES = {
    ("POST", "/v1/jobs"): "write",
    ("GET", "/v1/jobs"): "read",
    ("GET", "/v1/jobs/{job_id}"): "read",
    ("POST", "/v1/jobs/{job_id}/cancel"): "write",
    ("GET", "/v1/jobs/{job_id}/events"): "read",
    ("GET", "/v1/jobs/{job_id}/events/stream"): "read",
    ("GET", "/v1/jobs/{job_id}/checkpoints"): "read",
    ("GET", "/v1/jobs/changes"): "read",
    ("GET", "/v1/me"): "read",
    ("GET", "/v1/usage"): "read",
}
#: Routes of the whole cluster: an operator key's alone (admin, its own tenant's everything, does not imply it).
OPERATOR_ROUTES = {("GET", "/v1/cluster")}


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def submit(client: Any, key: str, config: dict[str, Any] | None = None, idempotency_key: str | None = None, **fields: Any) -> Any:
    headers = auth(key) if idempotency_key is None else auth(key, **{"Idempotency-Key": idempotency_key})
    return client.post("/v1/jobs", json={"kind": "train", "config": config or CONFIG, **fields}, headers=headers)


def routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves, HEAD aside.

    Newer FastAPI keeps included routers as one entry of ``app.routes``: ``iter_route_contexts`` flattens them.
    """
    from fastapi import routing

    flatten = getattr(routing, "iter_route_contexts", None)
    found = []
    for route in (flatten(app.routes) if flatten is not None else app.routes):
        assert hasattr(route, "methods"), f"{route!r}: a mount or websocket route; extend the matrix to walk it"
        found += [(m, route.path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return found


def concrete(path: str, job_id: str) -> str:
    """A route's template with its parameters filled: ``{job_id}`` with a real job, anything else with a placeholder."""
    parts = []
    for part in path.split("/"):
        if part.startswith("{"):
            parts.append(job_id if part.split(":")[0] == "{job_id}" else "x")
        else:
            parts.append(part)
    return "/".join(parts)


def call(client: Any, method: str, path: str, headers: dict[str, str]) -> Any:
    return client.request(method, path, headers=headers, json={} if method in ("POST", "PUT", "PATCH") else None)


def scope_refused(response: Any) -> bool:
    """A 403 from the scope check (not a route's own 403, such as a worker acting for another worker)."""
    return response.status_code == 403 and response.json()["error"]["type"] in ("scope", "not_a_worker")


# ----- auth ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_auth_matrix_from_the_route_table(make_client, keys, db_url) -> None:
    client = make_client(changes_max_s=0.05)  # the job-list stream ends at once here (a client connects again)
    owner = keys.new("acme", "read,write")
    job_id = submit(client, owner).json()["id"]
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(owner)).json()["state"] == "cancelled"  # streams end at once
    revoked = keys.new("acme", "admin")
    engine = make_engine(db_url)
    assert revoke_key(engine, revoked.split("_")[1])
    engine.dispose()
    good_id = owner.split("_")[1]
    bad_keys = {
        "none": {},
        "empty bearer": {"Authorization": "Bearer "},
        "malformed": auth("not-a-key"),
        "unknown": auth("tgk_0123456789ab_" + "A" * 43),
        "wrong secret": auth(f"tgk_{good_id}_" + "B" * 43),
        "revoked": auth(revoked),
        "basic scheme": {"Authorization": f"Basic {owner}"},
    }
    scoped = {scope: keys.new("acme", scope) for scope in SCOPES}
    table = routes(client.app)
    assert len(table) >= len(JOB_ROUTE_SCOPES) + 3  # health, readiness and the OpenAPI document besides
    for method, path in table:
        url = concrete(path, job_id)
        if path in PUBLIC_PATHS:
            assert call(client, method, url, {}).status_code in (200, 503)
            continue
        for name, headers in bad_keys.items():
            response = call(client, method, url, headers)
            assert response.status_code == 401, (method, path, name, response.status_code)
            assert response.json()["error"]["type"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
        allowed = set()
        for scope, key in scoped.items():
            response = call(client, method, url, auth(key))
            assert response.status_code != 401 and response.status_code < 500, (method, path, scope, response.text)
            if not scope_refused(response):
                allowed.add(scope)
        if path.startswith("/v1/workers") and (method, path) != ("GET", "/v1/workers"):
            # A worker's own routes: a worker credential's alone, never a tenant's key (admin included).
            assert allowed == {"worker"}, (method, path, allowed)
            continue
        if (method, path) in OPERATOR_ROUTES:
            assert allowed == {"operator"}, (method, path, allowed)
            continue
        assert "admin" in allowed, (method, path, "admin holds every scope of its tenant")
        if (method, path) in ANY_SCOPE_ROUTES:
            assert allowed == set(SCOPES), (method, path, allowed)
        else:
            assert allowed != set(SCOPES), f"{method} {path} takes every scope: does it check one?"
        if (method, path) in JOB_ROUTE_SCOPES:
            assert allowed == {JOB_ROUTE_SCOPES[(method, path)], "admin"}, (method, path, allowed)
    assert set(JOB_ROUTE_SCOPES) <= set(table), "a job route is missing from the app"


def test_a_revoked_key_stops_at_once(make_client, keys, db_url) -> None:
    client = make_client()
    key = keys.new()
    assert client.get("/v1/jobs", headers=auth(key)).status_code == 200
    engine = make_engine(db_url)
    assert revoke_key(engine, key.split("_")[1])
    engine.dispose()
    assert client.get("/v1/jobs", headers=auth(key)).status_code == 401


def test_other_tenants_jobs_are_not_found(make_client, keys) -> None:
    client = make_client()
    mine, theirs = keys.new("acme", "read,write"), keys.new("globex", "admin")
    job_id = submit(client, mine).json()["id"]
    for method, path in (
        ("GET", f"/v1/jobs/{job_id}"), ("POST", f"/v1/jobs/{job_id}/cancel"), ("GET", f"/v1/jobs/{job_id}/events"),
        ("GET", f"/v1/jobs/{job_id}/checkpoints"), ("GET", f"/v1/jobs/{job_id}/events/stream"),
    ):
        response = call(client, method, path, auth(theirs))
        assert response.status_code == 404, (method, path, response.status_code)
        assert response.json()["error"]["type"] == "not_found"
        assert call(client, method, path.replace(job_id, "job_nope"), auth(mine)).status_code == 404
    assert client.get("/v1/jobs", headers=auth(theirs)).json()["jobs"] == []
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(mine)).json()["state"] == "queued"  # the cancel did nothing


# ----- Idempotency-Key -------------------------------------------------------------------------------
def test_idempotency_key_replays_and_refuses_another_body(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    first = submit(client, key, idempotency_key="k-1")
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = submit(client, key, idempotency_key="k-1")
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    other = submit(client, key, config={**CONFIG, "steps": 4}, idempotency_key="k-1")
    assert other.status_code == 422 and other.json()["error"]["type"] == "idempotency_key_reused"
    # Scoped by tenant: another tenant's same key is a new request.
    assert submit(client, keys.new("globex"), idempotency_key="k-1").json()["id"] != first.json()["id"]
    assert len(client.get("/v1/jobs", headers=auth(key)).json()["jobs"]) == 1
    assert submit(client, key, idempotency_key="").status_code == 400


def test_100_parallel_submissions_with_one_key_make_one_job(db_url, keys, tmp_path: Path) -> None:
    key = keys.new()
    live = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data"), background=False))
    body = json.dumps({"kind": "train", "config": CONFIG, "name": "once"}).encode()
    idem = str(uuid.uuid4())
    barrier = threading.Barrier(100)

    def post(_: int) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
        try:
            conn.connect()
            barrier.wait()
            conn.request("POST", "/v1/jobs", body=body, headers=auth(key, **{"Idempotency-Key": idem, "Content-Type": "application/json"}))
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    try:
        with ThreadPoolExecutor(100) as pool:
            answers = list(pool.map(post, range(100)))
    finally:
        live.stop()
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {201, 409}, statuses
    created = {payload["id"] for status, payload in answers if status == 201}
    assert len(created) == 1, created
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(jobs)).scalar_one() == 1
            assert conn.execute(select(jobs.c.id)).scalar_one() in created
            assert conn.execute(select(func.count()).select_from(idempotency)).scalar_one() == 1
    finally:
        engine.dispose()


# ----- listing -----------------------------------------------------------------------------------------
def test_cursor_pages_walk_every_job_exactly_once(make_client, keys) -> None:
    client = make_client(clock=lambda: 1_000_000.0)  # every job the same age: the id breaks the ties
    key = keys.new()
    made = {submit(client, key, name=f"j{i}").json()["id"] for i in range(23)}
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        params = {"limit": 5, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params, headers=auth(key)).json()
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 23 and set(seen) == made
    assert seen == sorted(seen, reverse=True)
    # Filters combine with pages.
    client.post(f"/v1/jobs/{seen[0]}/cancel", headers=auth(key))
    only = client.get("/v1/jobs", params={"state": "cancelled"}, headers=auth(key)).json()["jobs"]
    assert [j["id"] for j in only] == [seen[0]]
    assert client.get("/v1/jobs", params={"state": "nope"}, headers=auth(key)).status_code == 400
    assert client.get("/v1/jobs", params={"kind": "nope"}, headers=auth(key)).status_code == 400


def test_newer_jobs_do_not_shift_a_walk_in_progress(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    made = [submit(client, key).json()["id"] for _ in range(6)]
    page = client.get("/v1/jobs", params={"limit": 3}, headers=auth(key)).json()
    submit(client, key)  # newer than the cursor: not part of this walk
    rest = client.get("/v1/jobs", params={"limit": 3, "cursor": page["next_cursor"]}, headers=auth(key)).json()
    assert {j["id"] for j in page["jobs"] + rest["jobs"]} == set(made)


@pytest.mark.parametrize("cursor", [
    "!!!", "abc", "bm90IGpzb24", base64.urlsafe_b64encode(b"[1, 2]").decode(), base64.urlsafe_b64encode(b'{"t": "x", "id": 1}').decode(),
    base64.urlsafe_b64encode(b'{"t": 1}').decode(), "\u00e9\u00e9", "x" * 201,
    base64.urlsafe_b64encode(b'{"t": 1, "id": "job_a\\u0000b"}').decode(), base64.urlsafe_b64encode(b'{"t": 1, "id": 7}').decode(),
])
def test_a_malformed_cursor_is_400(make_client, keys, cursor: str) -> None:
    client = make_client()
    response = client.get("/v1/jobs", params={"cursor": cursor}, headers=auth(keys.new()))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request"


# ----- limits and quotas -------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413(make_client, keys) -> None:
    client = make_client(max_body_bytes=2000)
    key = keys.new()
    big = {"kind": "train", "config": {**CONFIG, "note": "x" * 3000}}
    response = client.post("/v1/jobs", json=big, headers=auth(key))
    assert response.status_code == 413 and response.json()["error"]["type"] == "body_too_large"
    # Without a Content-Length (chunked), the limit is counted as the body streams in.
    data = json.dumps(big).encode()
    chunked = client.post("/v1/jobs", content=iter([data[:1000], data[1000:]]), headers=auth(key, **{"Content-Type": "application/json"}))
    assert chunked.status_code == 413
    assert submit(client, key).status_code == 201
    assert client.get("/v1/jobs", headers=auth(key)).json()["jobs"][0]["config"] == CONFIG


def test_queued_quota_is_429_and_not_stored_under_the_key(make_client, keys, db_url) -> None:
    client = make_client()
    key = keys.new("small")
    engine = make_engine(db_url)
    with engine.begin() as conn:
        ensure_tenant(conn, "small", max_queued=2)
    engine.dispose()
    first = [submit(client, key).json()["id"] for _ in range(2)]
    refused = submit(client, key, idempotency_key="third")
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "quota"
    again = submit(client, key, idempotency_key="third")
    assert again.status_code == 429 and "idempotent-replayed" not in again.headers
    assert client.post(f"/v1/jobs/{first[0]}/cancel", headers=auth(key)).status_code == 200
    ran = submit(client, key, idempotency_key="third")  # room again: the same key now runs
    assert ran.status_code == 201 and "idempotent-replayed" not in ran.headers
    assert submit(client, key, idempotency_key="third").json()["id"] == ran.json()["id"]
    engine = make_engine(db_url)
    with engine.begin() as conn:
        ensure_tenant(conn, "small", max_gpus=0)  # a job of one device is past a quota of none
    engine.dispose()
    too_big = submit(client, key)
    assert too_big.status_code == 400 and "tenant 'small' may hold at most 0" in too_big.json()["error"]["message"]


# ----- cancel ------------------------------------------------------------------------------------------
def test_cancel_a_queued_job_then_again(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    job_id = submit(client, key).json()["id"]
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None and cancelled.json()["queue_position"] is None
    twice = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key))
    assert twice.status_code == 409 and twice.json()["error"]["type"] == "conflict"
    events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).json()
    assert [(e["seq"], e["data"]["state"]) for e in events["events"]] == [(1, "queued"), (2, "cancelled")]
    assert events["cursor"] == 2
    assert client.get(f"/v1/jobs/{job_id}/events", params={"after": 2}, headers=auth(key)).json() == {"events": [], "cursor": 2}
    assert client.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(key)).json() == {"checkpoints": []}
    # A replayed cancel (same Idempotency-Key) answers what the first one did, not 409.
    other = submit(client, key).json()["id"]
    first = client.post(f"/v1/jobs/{other}/cancel", headers=auth(key, **{"Idempotency-Key": "c1"}))
    replay = client.post(f"/v1/jobs/{other}/cancel", headers=auth(key, **{"Idempotency-Key": "c1"}))
    assert first.status_code == replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"


# ----- hostile config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [
    {"model": "/home/me/models/qwen"}, {"model": "../../etc"}, {"model": "./model"}, {"model": "org/../x"},
    {"model": "C:\\models\\x"}, {"model": "~/m"}, {"model": 3}, {"env": "tinker/Bandit-v0"},
    {"model": "smollm2-135m", "out": "/tmp/run"}, {"model": "smollm2-135m", "resume": "runs/a"},
])
def test_a_config_naming_a_path_is_400(make_client, keys, config: dict[str, Any]) -> None:
    client = make_client()
    key = keys.new()
    response = submit(client, key, config=config)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request"
    assert client.get("/v1/jobs", headers=auth(key)).json()["jobs"] == []


@pytest.mark.parametrize(("setting", "value"), [
    ("dtype", "float16"), ("lora_rank", -1), ("lora_rank", 5000), ("lora_rank", "eight"), ("lora_alpha", 0), ("lora_dropout", 1.0),
    ("micro_batch_size", 0), ("seed", -1), ("seed", 2**32), ("deterministic", "maybe"), ("resume_job", "../job_1"), ("served_name", "a b"),
])
def test_a_server_setting_that_cannot_work_is_refused_at_submission(make_client, keys, setting: str, value: Any) -> None:
    """Typed and checked when the job is submitted, not when a worker starts its server (which would fail the job)."""
    client = make_client()
    key = keys.new()
    response = submit(client, key, config={"model": "tiny", setting: value})
    assert response.status_code == 400 and setting in response.text, response.text
    assert client.get("/v1/jobs", headers=auth(key)).json()["jobs"] == []


def test_a_job_keeps_its_config_as_sent(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    config = {"model": "tiny", "lora_rank": 4, "lora_alpha": 8, "seed": 3, "env": "tinker/Bandit-v0", "steps": 2}
    job = submit(client, key, config=config).json()
    assert job["config"] == config, "no default is added and the run's other settings stay"
    document = client.get("/openapi.json", headers=auth(key)).json()
    typed = document["components"]["schemas"]["JobConfig"]["properties"]
    assert {"model", "dtype", "lora_rank", "lora_alpha", "seed", "resume_job", "served_name"} <= set(typed)


def test_hostile_ids_names_and_cursors_are_4xx_not_500(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    job_id = submit(client, key).json()["id"]
    for bad_id in ("a%00b", "x" * 5000, "%E2%80%AE"):
        for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/events"), ("GET", "/checkpoints"), ("GET", "/events/stream")):
            response = call(client, method, f"/v1/jobs/{bad_id}{path}", auth(key))
            assert response.status_code == (400 if "%00" in bad_id else 404), (bad_id, path, response.status_code)  # NUL: refused at the edge
    for name in ("a\x00b", "\x1b[31mred", "line\nbreak"):
        assert submit(client, key, name=name).status_code == 400
    huge = str(10**20)
    assert client.get(f"/v1/jobs/{job_id}/events", params={"after": huge}, headers=auth(key)).status_code == 400
    assert client.get(f"/v1/jobs/{job_id}/events/stream", params={"after": huge}, headers=auth(key)).status_code == 400
    for last in (huge, "-1", "1.5", "\u0661".encode()):
        response = client.get(f"/v1/jobs/{job_id}/events/stream", headers=auth(key, **{"Last-Event-ID": last}))
        assert response.status_code == 400, (last, response.status_code)


@pytest.mark.parametrize("text", ["lone \ud800 surrogate", "a\x00b", "\udfff"])
def test_text_that_cannot_be_answered_is_never_committed(make_client, keys, text: str) -> None:
    """A lone surrogate or a NUL anywhere in a request (config values and keys, the name, the query) is 400 before any
    route runs: nothing is stored, the owner's list still answers, and a retry with the Idempotency-Key is no replay."""
    client = make_client()
    key = keys.new()
    headers = auth(key, **{"Content-Type": "application/json", "Idempotency-Key": "poison-1"})
    bodies = [{"kind": "train", "config": {**CONFIG, "note": text}}, {"kind": "train", "config": {**CONFIG, text: 1}},
              {"kind": "train", "config": {**CONFIG, "deep": [{"x": [text]}]}}, {"kind": "train", "config": CONFIG, "name": text}]
    for body in bodies:
        for _ in range(2):  # the retry meets the same check, not a stored answer
            response = client.post("/v1/jobs", content=json.dumps(body).encode(), headers=headers)
            assert response.status_code == 400, (body, response.status_code, response.text)
            assert "lone UTF-16 surrogate" in response.json()["error"]["message"]
    assert client.get("/v1/jobs", headers=auth(key)).json()["jobs"] == []
    assert client.get("/v1/jobs?cursor=a%00b", headers=auth(key)).status_code == 400  # a query string carries NUL percent-encoded
    clean = client.post("/v1/jobs", content=json.dumps({"kind": "train", "config": CONFIG}).encode(), headers=headers)
    assert clean.status_code == 201 and client.get("/v1/jobs", headers=auth(key)).status_code == 200


def test_a_stored_lone_surrogate_is_still_answered() -> None:
    """What was stored before the edge check refused it can always be sent: as a JSON escape, which reads back the same."""
    from tinkergym.serve.asgi import WireJSON

    content = {"config": {"note": "bad \ud800 text", "ok": "é"}}
    body = WireJSON(content).body
    body.decode("utf-8")  # valid UTF-8
    assert json.loads(body) == content


def test_malformed_bodies_are_400_not_500(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    headers = auth(key, **{"Content-Type": "application/json"})
    for body in (b"", b"{", b"[]", b'{"kind": "train"}', b'{"kind": "nope", "config": {"model": "m"}}',
                 b'{"kind": "train", "config": {"model": "m"}, "gpus": 0}', b'{"kind": "train", "config": {"model": "m"}, "extra": 1}'):
        response = client.post("/v1/jobs", content=body, headers=headers)
        assert response.status_code == 400, (body, response.status_code, response.text)


# ----- the OpenAPI document ------------------------------------------------------------------------------
def test_openapi_lists_every_route(make_client, keys) -> None:
    client = make_client()
    assert client.get("/openapi.json").status_code == 401  # the document needs a key too
    document = client.get("/openapi.json", headers=auth(keys.new("acme", "read"))).json()
    listed = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    for method, path in routes(client.app):
        if path in ("/openapi.json",):
            continue
        assert (method, path.replace(":path}", "}")) in listed, (method, path)  # the document omits the {path:path} converter
    stream = document["paths"]["/v1/jobs/{job_id}/events/stream"]["get"]
    assert "text/event-stream" in stream["responses"]["200"]["content"]


def test_show_counts_the_queue_position_by_priority_then_age(make_client, keys) -> None:
    client = make_client()
    key = keys.new()
    old, new, urgent = (submit(client, key, priority=p) for p in (0, 0, 5))
    assert all(r.status_code == 201 and r.json()["queue_position"] is None for r in (old, new, urgent))  # not counted on submit
    position = {name: client.get(f"/v1/jobs/{r.json()['id']}", headers=auth(key)).json()["queue_position"]
                for name, r in (("old", old), ("new", new), ("urgent", urgent))}
    assert position == {"urgent": 1, "old": 2, "new": 3}
    client.post(f"/v1/jobs/{urgent.json()['id']}/cancel", headers=auth(key))
    assert client.get(f"/v1/jobs/{new.json()['id']}", headers=auth(key)).json()["queue_position"] == 2
