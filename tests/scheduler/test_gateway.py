"""The inference gateway: ``/v1/jobs/{id}/openai/v1/...`` on the scheduler, forwarded to the job's current server.

The job's server is a stand-in here (a small HTTP server on 127.0.0.1 that records what reaches it), registered as
the job's ``server_url`` by a fake worker through the worker API; the scheduler runs under uvicorn, so streams are
real. The last test serves a real model with a real worker.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import httpx
import pytest

import workerkit as kit
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tinkergym.serve.asgi import ThreadServer
from tinkergym.scheduler import leases
from tinkergym.scheduler.app import SchedulerSettings, create_app

TTL = 30.0


class Upstream:
    """A stand-in for a job's inference server: records every request; ``stream: true`` answers two SSE events, the
    second only once ``release`` is set; ``refuse`` answers 401 (as a server past its lease's end)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.refuse = False
        self.server = ThreadServer(Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])]))
        self.url = self.server.url

    async def handle(self, request: Request) -> Any:
        import anyio.to_thread

        body = await request.body()
        self.seen.append({"method": request.method, "path": request.url.path, "query": request.url.query,
                          "headers": dict(request.headers), "body": body})
        if self.refuse:
            return JSONResponse({"error": {"type": "lease_ended"}}, status_code=401)
        if body and json.loads(body).get("stream"):
            async def events() -> Any:
                yield f"data: {json.dumps({'from': self.name, 'n': 1})}\n\n".encode()
                released = await anyio.to_thread.run_sync(self.release.wait, 60.0)
                yield (b"data: [DONE]\n\n" if released else b"data: never released\n\n")

            return StreamingResponse(events(), media_type="text/event-stream")
        if request.url.path == "/v1/missing":
            return JSONResponse({"error": {"type": "not_found"}}, status_code=404)
        return JSONResponse({"from": self.name, "path": request.url.path}, headers={"X-Internal": "upstream"})

    def stop(self) -> None:
        self.release.set()
        self.server.stop()


class Setup:
    """A scheduler under uvicorn (fake clock, no sweeper), an HTTP client on it, keys and upstreams."""

    def __init__(self, db_url: str, tmp_path: Path, keys: Any, **settings: Any) -> None:
        self.clock = kit.Clock()
        self.app = create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", lease_ttl_s=TTL, clock=self.clock, **settings),
                              background=False)
        self.server = ThreadServer(self.app)
        self.http = httpx.Client(base_url=self.server.url, timeout=30.0)
        self.owner = keys.new("acme", "read,write")
        self.keys = keys
        self.upstreams: list[Upstream] = []

    def upstream(self, name: str) -> Upstream:
        self.upstreams.append(Upstream(name))
        return self.upstreams[-1]

    def submit(self, kind: str = "inference", key: str | None = None) -> str:
        response = self.http.post("/v1/jobs", json={"kind": kind, "config": {"model": "tiny"}, "gpus": 1}, headers=kit.auth(key or self.owner))
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run_on(self, worker: Any, job_id: str, upstream: Upstream) -> int:
        """``worker`` leases ``job_id`` and reports it running at ``upstream``; the lease's epoch."""
        lease = worker.lease()
        assert lease is not None and lease["job_id"] == job_id
        for state in ("starting", "running"):
            assert worker.state(job_id, lease["epoch"], state, server_url=upstream.url).status_code == 200
        return lease["epoch"]

    def base(self, job_id: str) -> str:
        return f"/v1/jobs/{job_id}/openai/v1"

    def owner_key_reached_an_upstream(self) -> bool:
        return any(self.owner in json.dumps({k: v for k, v in seen["headers"].items()}) or self.owner.encode() in seen["body"]
                   for upstream in self.upstreams for seen in upstream.seen)

    def close(self) -> None:
        for upstream in self.upstreams:
            upstream.stop()
        self.http.close()
        self.server.stop()


@pytest.fixture
def make_setup(db_url: str, tmp_path: Path, keys: Any) -> Iterator[Any]:
    made: list[Setup] = []

    def make(**settings: Any) -> Setup:
        made.append(Setup(db_url, tmp_path, keys, **settings))
        return made[-1]

    yield make
    for setup in made:
        setup.close()


def test_a_call_is_forwarded_with_the_epochs_token_and_never_the_owners_key(make_setup: Any) -> None:
    s = make_setup(max_body_bytes=4096)
    upstream = s.upstream("a")
    worker = kit.register(s.http, s.keys.worker(2))
    job_id = s.submit()
    epoch = s.run_on(worker, job_id, upstream)
    token = leases.token_for(s.app, job_id, epoch)

    headers = {**kit.auth(s.owner), "X-Api-Key": s.owner, "Cookie": f"k={s.owner}", "Accept": "application/json"}
    models = s.http.get(f"{s.base(job_id)}/models", headers=headers)
    assert models.status_code == 200 and models.json() == {"from": "a", "path": "/v1/models"}
    assert models.headers["content-type"] == "application/json" and "x-internal" not in models.headers
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    chat = s.http.post(f"{s.base(job_id)}/chat/completions?trace=1&x=%20y", json=body, headers=headers)
    assert chat.status_code == 200 and chat.json()["path"] == "/v1/chat/completions"
    missing = s.http.get(f"{s.base(job_id)}/missing", headers=headers)
    assert missing.status_code == 404 and missing.json() == {"error": {"type": "not_found"}}  # the server's answer, as it is

    for escaping in ("..%2F..%2Fhealthz", "%2E%2E/%2E%2E/healthz", "models%3Fx=1%23"):
        assert s.http.get(f"{s.base(job_id)}/{escaping}", headers=headers).status_code in (200, 404)
    assert [seen["path"] for seen in upstream.seen[3:]] == ["/v1/models%3Fx=1%23"]  # within /v1, encoded as it came
    del upstream.seen[3:]
    first, second, _ = upstream.seen
    assert (first["method"], first["path"], first["body"]) == ("GET", "/v1/models", b"")
    assert (second["method"], second["path"], second["query"]) == ("POST", "/v1/chat/completions", "trace=1&x=%20y")
    assert json.loads(second["body"]) == body and second["headers"]["content-type"] == "application/json"
    assert all(seen["headers"]["authorization"] == f"Bearer {token}" for seen in upstream.seen)
    assert not any("x-api-key" in seen["headers"] or "cookie" in seen["headers"] for seen in upstream.seen)
    assert not s.owner_key_reached_an_upstream()

    too_big = s.http.post(f"{s.base(job_id)}/completions", content=b'{"prompt": "' + b"x" * 5000 + b'"}',
                          headers={**kit.auth(s.owner), "Content-Type": "application/json"})
    assert too_big.status_code == 413 and len(upstream.seen) == 3  # refused here, never forwarded


def test_a_streamed_answer_passes_through_chunk_by_chunk(make_setup: Any) -> None:
    s = make_setup()
    upstream = s.upstream("a")
    worker = kit.register(s.http, s.keys.worker(2))
    job_id = s.submit()
    s.run_on(worker, job_id, upstream)
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    with s.http.stream("POST", f"{s.base(job_id)}/completions", json=body, headers=kit.auth(s.owner)) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        # The first event arrives while the server still holds back the second: nothing waits for the whole answer.
        assert next(lines) == 'data: {"from": "a", "n": 1}'
        upstream.release.set()
        assert [line for line in lines if line] == ["data: [DONE]"]
    assert not s.owner_key_reached_an_upstream()


def test_a_revoked_keys_open_stream_ends_at_once_and_another_keys_goes_on(make_setup: Any, db_url: str) -> None:
    """A streamed completion whose key is revoked mid-answer ends with an error event at the watcher's next pass (the
    server still holding back its answer); another key's stream of the same job is untouched."""
    from tinkergym.scheduler.auth import KEY_PATTERN, revoke_key
    from tinkergym.scheduler.db import make_engine

    s = make_setup()
    upstream = s.upstream("a")
    worker = kit.register(s.http, s.keys.worker(2))
    job_id = s.submit()
    s.run_on(worker, job_id, upstream)
    doomed = s.keys.new("acme", "read,write")
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    with s.http.stream("POST", f"{s.base(job_id)}/completions", json=body, headers=kit.auth(doomed)) as cut, \
            s.http.stream("POST", f"{s.base(job_id)}/completions", json=body, headers=kit.auth(s.owner)) as kept:
        cut_lines, kept_lines = cut.iter_lines(), kept.iter_lines()
        assert next(cut_lines) == next(kept_lines) == 'data: {"from": "a", "n": 1}'
        hub = s.app.state.streams  # each answer watches its key, outside the event streams' limits
        assert len(hub.subscriptions) == 2 and hub.streams_open() == 0 and not hub.per_key
        engine = make_engine(db_url)
        try:
            assert revoke_key(engine, KEY_PATTERN.match(doomed).group(1))
        finally:
            engine.dispose()
        started = time.monotonic()
        rest = [line for line in cut_lines if line]
        assert time.monotonic() - started < 10 and not upstream.release.is_set()
        assert len(rest) == 1 and json.loads(rest[0].removeprefix("data: "))["error"]["type"] == "unauthorized", rest
        upstream.release.set()
        assert [line for line in kept_lines if line] == ["data: [DONE]"]
    assert s.http.get(f"{s.base(job_id)}/models", headers=kit.auth(doomed)).status_code == 401
    assert s.app.state.gateway.in_flight == {} and not s.app.state.streams.subscriptions  # every slot freed


def test_the_same_url_follows_the_job_to_its_next_server_and_token(make_setup: Any) -> None:
    s = make_setup()
    old, new = s.upstream("old"), s.upstream("new")
    w1, w2 = kit.register(s.http, s.keys.worker(1), name="w1", devices=1), kit.register(s.http, s.keys.worker(1), name="w2", devices=1)
    job_id = s.submit()
    url, headers = f"{s.base(job_id)}/models", kit.auth(s.owner)

    queued = s.http.get(url, headers=headers)
    assert queued.status_code == 503 and int(queued.headers["retry-after"]) > 0 and "queued" in queued.json()["error"]["message"]
    first = s.run_on(w1, job_id, old)
    assert s.http.get(url, headers=headers).json()["from"] == "old"

    old.refuse = True  # its lease ended on the server: what the client sees is "retry", not a bad key
    refused = s.http.get(url, headers=headers)
    assert refused.status_code == 503 and "retry-after" in refused.headers
    old.server.stop()  # the worker died with its server: until the lease expires, still "retry"
    dead = s.http.get(url, headers=headers)
    assert dead.status_code == 503 and "retry-after" in dead.headers and "does not answer" in dead.json()["error"]["message"]
    s.clock.advance(TTL + 1)
    assert leases.sweep(s.app) == 1
    requeued = s.http.get(url, headers=headers)
    assert requeued.status_code == 503 and "retry-after" in requeued.headers

    second = s.run_on(w2, job_id, new)
    assert second > first
    moved = s.http.get(url, headers=headers)
    assert moved.status_code == 200 and moved.json()["from"] == "new"
    assert new.seen[-1]["headers"]["authorization"] == f"Bearer {leases.token_for(s.app, job_id, second)}"
    assert [seen["headers"]["authorization"] for seen in old.seen] == [f"Bearer {leases.token_for(s.app, job_id, first)}"] * 2
    assert not s.owner_key_reached_an_upstream()


def test_only_the_owners_served_jobs_pass(make_setup: Any) -> None:
    s = make_setup()
    upstream = s.upstream("a")
    worker = kit.register(s.http, s.keys.worker(2))
    served = s.submit()
    s.run_on(worker, served, upstream)
    training = s.submit(kind="train")
    s.run_on(worker, training, upstream)
    other, reader = s.keys.new("globex", "read,write"), s.keys.new("acme", "read")

    assert s.http.get(f"{s.base(served)}/models", headers=kit.auth(other)).status_code == 404
    assert s.http.get(f"{s.base(training)}/models", headers=kit.auth(s.owner)).status_code == 404  # training traffic never passes here
    assert s.http.get(f"{s.base('job_nope')}/models", headers=kit.auth(s.owner)).status_code == 404
    assert s.http.get(f"{s.base(served)}/models", headers=kit.auth(reader)).status_code == 403
    assert s.http.get(f"{s.base(served)}/models").status_code == 401
    assert upstream.seen == []

    assert s.http.post(f"/v1/jobs/{served}/cancel", headers=kit.auth(s.owner)).status_code == 200
    assert s.http.get(f"{s.base(served)}/models", headers=kit.auth(s.owner)).status_code == 409  # cancelling: no new calls
    lease_epoch = kit.job_row(s.keys.db_url, served)["lease_epoch"]
    assert worker.state(served, lease_epoch, "cancelled").status_code == 200
    ended = s.http.get(f"{s.base(served)}/models", headers=kit.auth(s.owner))
    assert ended.status_code == 409 and "cancelled" in ended.json()["error"]["message"]
    assert upstream.seen == []


def test_a_tenant_has_a_bounded_number_of_requests_in_flight(make_setup: Any) -> None:
    s = make_setup(gateway_max_per_tenant=1)
    upstream = s.upstream("a")
    worker = kit.register(s.http, s.keys.worker(2))
    job_id = s.submit()
    s.run_on(worker, job_id, upstream)
    other = s.keys.new("globex", "read,write")
    their_job = s.submit(key=other)
    s.run_on(worker, their_job, upstream)
    with s.http.stream("POST", f"{s.base(job_id)}/completions", json={"stream": True}, headers=kit.auth(s.owner)) as held:
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection, which ends the request
        assert next(lines).startswith("data: ")
        busy = s.http.get(f"{s.base(job_id)}/models", headers=kit.auth(s.owner))
        assert busy.status_code == 429 and "retry-after" in busy.headers
        assert s.http.get(f"{s.base(their_job)}/models", headers=kit.auth(other)).status_code == 200  # another tenant's own count
        upstream.release.set()
        assert [line for line in lines if line] == ["data: [DONE]"]
    assert s.http.get(f"{s.base(job_id)}/models", headers=kit.auth(s.owner)).status_code == 200  # the slot is free again

    upstream.release.clear()
    with s.http.stream("POST", f"{s.base(job_id)}/completions", json={"stream": True}, headers=kit.auth(s.owner)) as gone:
        assert next(gone.iter_lines()).startswith("data: ")
    upstream.release.set()  # the client went away mid-stream: its slot is freed once the gateway notices
    answers = []
    for _ in range(200):
        answers.append(s.http.get(f"{s.base(job_id)}/models", headers=kit.auth(s.owner)).status_code)
        if answers[-1] != 429:
            break
        time.sleep(0.05)
    assert answers[-1] == 200, answers


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # real processes end to end: one database (see tests/scheduler/conftest.py)
def test_a_job_served_by_a_real_worker_answers_an_openai_client_through_the_gateway(db_url: str, keys: Any, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    openai = pytest.importorskip("openai")
    from click.testing import CliRunner

    from tinkergym.cli import main

    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))
    owner, worker_key = keys.new("acme", "read,write"), keys.new("ops", "worker")
    monkeypatch.setenv("TINKERGYM_API_KEY", owner)
    scheduler = kit.serve_scheduler(db_url, tmp_path / "data", lease_ttl_s=5.0, sweep_interval_s=0.2)
    worker = kit.WorkerProcess(scheduler.url, worker_key, tmp_path / "w1", "w1")
    try:
        served = CliRunner().invoke(main, ["serve", "model", "--scheduler", scheduler.url, "--model", "tiny", "--dtype", "float32", "--detach",
                                           "--key-file", str(tmp_path / "endpoint.key")], catch_exceptions=False)
        assert served.exit_code == 0, served.output
        endpoint = json.loads(served.stdout.splitlines()[-1])
        assert endpoint["base_url"] == f"{scheduler.url}/v1/jobs/{endpoint['job']}/openai/v1" and endpoint["base_url"] in served.output

        client = openai.OpenAI(base_url=endpoint["base_url"], api_key=owner, max_retries=0)
        assert [m.id for m in client.models.list()] == endpoint["models"] == ["tiny"]
        chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.0, stream=True))
        assert chunks and all(chunk.object == "text_completion" for chunk in chunks)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=endpoint["base_url"], api_key=(tmp_path / "endpoint.key").read_text().strip(), max_retries=0).models.list()
        assert CliRunner().invoke(main, ["jobs", "cancel", endpoint["job"], "--scheduler", scheduler.url]).exit_code == 0
    finally:
        worker.stop()
        scheduler.stop()
