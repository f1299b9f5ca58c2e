"""The training server: auth on every route, exact round trips, sequence numbers, long polls, names, limits, CLI."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import testkit  # registered by tests/conftest.py

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("httpx")

import httpx
import torch
from click.testing import CliRunner
from fastapi.testclient import TestClient

from testkit import serving  # registered by tests/conftest.py

from tinkergym.serve.training.app import create_app
from tinkergym.serve.training.calls import CallLimits
from tinkergym.serve.auth import token_digest
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    LossSpec,
    OptimParams,
    SampleRequest,
    SamplingParams,
)
from tinkergym.cli import main

TOKEN = "t" * 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPTIM = OptimParams(learning_rate=1e-2)


def make_backend(tiny: str) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", device="cpu", lora_rank=4, micro_batch_size=4, seed=3))


class Client:
    """A session on an app: numbered calls, as a remote backend makes them."""

    def __init__(self, http: Any) -> None:
        self.http = http
        self.session = http.post("/v1/sessions", headers=AUTH).json()["session_id"]
        self.seq = 0

    def post(self, method: str, args: dict[str, Any], seq: int | None = None, wait: float = 30) -> Any:
        if seq is None:
            self.seq += 1
            seq = self.seq
        body = {"session_id": self.session, "seq": seq, "method": method, "args": args}
        return self.http.post(f"/v1/call?wait={wait}", headers=AUTH, json=body)

    def call(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        response = self.post(method, args)
        assert response.status_code == 200, response.text
        return response.json()["result"]


def serve(backend: Any, run_dir: Path, **options: Any) -> TestClient:
    return TestClient(create_app(backend, run_dir=run_dir, token_digest=token_digest(TOKEN), **options), raise_server_exceptions=False)


def batch(backend: TorchBackend) -> list[Datum]:
    data = []
    for i, text in enumerate(["The sun rises in the east.", "12 + 3 = 15", "Five in a row wins."]):
        tokens = backend.tokenizer.encode(text, add_special_tokens=False)
        current = backend.logprobs([tokens])[0]
        data.append(Datum(tokens, [0.0, 0.0] + [1.0] * (len(tokens) - 2), [(-1.0) ** i * (0.5 + i)] * len(tokens), [lp + 0.1 for lp in current]))
    return data


class FakeBackend:
    """Records calls; ``fail`` makes the next call raise it; ``delay`` slows ``forward_backward`` down."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail: BaseException | None = None
        self.delay = delay

    def _run(self, name: str, value: Any, result: Any) -> Any:
        self.calls.append((name, value))
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        return result

    def info(self) -> dict[str, Any]:
        return {"model": "/secret/path/model", "model_path": "/secret/path/model", "tokenizer": "/secret/path/model", "step": 0}

    def forward_backward(self, request: ForwardBackwardRequest) -> Any:
        time.sleep(self.delay)
        from tinkergym.protocol.types import ForwardBackwardResult

        return self._run("forward_backward", request, ForwardBackwardResult({"loss": 0.1 + 0.2}))

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        return self._run("optim_step", params, {"grad_norm": math.nan, "step": 1.0})

    def save_state(self, path: str) -> None:
        self._run("save_state", path, None)
        os.makedirs(path)
        Path(path, "state.json").write_text("{}")


def fb_args(tokens: list[int] | None = None) -> dict[str, Any]:
    tokens = tokens or [1, 2, 3]
    return {"request": ForwardBackwardRequest([Datum(tokens, [0.0] + [1.0] * (len(tokens) - 1))], LossSpec("cross_entropy")).to_dict()}


# ----- auth -----------------------------------------------------------------------------------------------
def all_routes(routes: list, prefix: str = "") -> list[tuple[str, Any]]:
    """``(path, route)`` of every route, inside included routers and mounts too (newer FastAPI keeps included routers whole)."""
    found = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found += all_routes(included.routes, prefix + route.include_context.prefix)
        elif getattr(route, "routes", None) is not None and hasattr(route, "path"):
            found += all_routes(route.routes, prefix + route.path)
        else:
            found.append((prefix + route.path, route))
    return found


def test_every_route_but_health_needs_the_token(tmp_path: Path) -> None:
    http = serve(FakeBackend(), tmp_path)
    checked = set()
    for route_path, route in all_routes(http.app.routes):
        path = re.sub(r"\{[^}]+\}", "x", route_path)
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method == "HEAD":
                continue
            for headers in ({}, {"Authorization": "Bearer " + "w" * 40}, {"Authorization": TOKEN}):
                response = http.request(method, path, headers=headers, json={})
                expected = 200 if route_path == "/health" else 401
                assert response.status_code == expected, (method, route_path, headers, response.text)
            checked.add(route_path)
    assert {"/health", "/openapi.json", "/v1/info", "/v1/tokenizer", "/v1/sessions", "/v1/call", "/v1/requests/{request_id}"} <= checked
    assert any(p.startswith("/v1/files/exports/") for p in checked)
    openapi = http.get("/openapi.json", headers=AUTH).json()
    assert set(openapi["paths"]) == {p.replace(":path", "") for p in checked if p != "/openapi.json"}


def test_no_route_fails_on_garbage_with_a_valid_token(tmp_path: Path) -> None:
    """Every documented route, with the token, answers garbage with a 4xx: nothing reaches a 500."""
    http = serve(FakeBackend(), tmp_path)
    openapi = http.get("/openapi.json", headers=AUTH).json()
    session = http.post("/v1/sessions", headers=AUTH).json()["session_id"]
    bodies = [None, b"", b"[]", b"null", b"\xff\xfe", b'{"session_id": 1}', json.dumps({"session_id": session, "seq": 1, "method": "sample", "args": {"request": None}}).encode()]
    values = ["x", "..", "%2e%2e", "%00", "a" * 300, "-1"]
    sent = 0
    for path, operations in openapi["paths"].items():
        for method in operations:
            for value in values if "{" in path else values[:1]:
                concrete = re.sub(r"\{[^}]+\}", value, path)
                for body in bodies if method == "post" else [None]:
                    for query in ("?wait=0", "?wait=x") if "wait" in json.dumps(operations[method]) else ("",):
                        response = http.request(method.upper(), concrete + query, headers=AUTH, content=body)
                        sent += 1
                        assert response.status_code < 500, (method, concrete, query, body, response.text)
                        assert response.headers["content-type"].startswith(("application/json", "application/octet-stream"))
    assert sent >= 40


def test_info_has_no_local_paths(tmp_path: Path) -> None:
    info = serve(FakeBackend(), tmp_path).get("/v1/info", headers=AUTH).json()
    assert info == {"model": "model", "step": 0, "protocol": 1, "limits": CallLimits().as_dict()}


# ----- exact round trip, retries, sequence numbers --------------------------------------------------------
def test_round_trip_equals_the_local_backend_bit_for_bit(tiny: str, tmp_path: Path) -> None:
    local, served = make_backend(tiny), make_backend(tiny)
    http = serve(served, tmp_path)
    client = Client(http)
    sample = SampleRequest([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=5, seed=11), num_samples=2)
    sampled = [client.call("sample", {"request": sample.to_dict()})]
    assert sampled[0] == local.sample(sample).to_dict()
    data = batch(local)
    assert client.call("logprobs", {"sequences": [d.tokens for d in data], "temperature": 0.7}) == {"logprobs": local.logprobs([d.tokens for d in data], 0.7)}
    request = ForwardBackwardRequest(data, LossSpec("ppo", kl_coef=0.05))
    assert client.call("forward_backward", {"request": request.to_dict()}) == local.forward_backward(request).to_dict()
    assert client.call("optim_step", {"params": OPTIM.to_dict()}) == {"metrics": local.optim_step(OPTIM)}
    for (name, a), (_, b) in zip(local.model.named_parameters(), served.model.named_parameters()):
        assert torch.equal(a, b), name
    sampled.append(client.call("sample", {"request": sample.to_dict()}))
    assert sampled[1] == local.sample(sample).to_dict()
    client.call("forward_backward", {"request": request.to_dict()})
    client.call("optim_step", {"params": OPTIM.to_dict()})
    testkit.check_training_metrics(http.app.state.metrics.render().decode(), "training")
    # What its worker reports for the tenant's usage: the rows of the two forward_backward calls, the new tokens of the
    # two samples; reading it is no client activity.
    drawn = sum(len(seq["tokens"]) for answer in sampled for row in answer["sequences"] for seq in row)
    touched = http.app.state.service.last_activity()
    usage = http.get("/v1/usage", headers=AUTH).json()
    memory = usage.pop("memory")
    assert usage == {"tokens_trained": 2 * sum(len(d.tokens) for d in data), "tokens_sampled": drawn}
    # its memory, measured (this test's process: the host is the device here), what the heartbeat carries for placement
    assert 0 < memory["host_bytes"] <= memory["host_peak_bytes"] and memory["device_bytes"] == memory["host_bytes"]
    assert memory["host_peak_bytes"] > sum(p.numel() * p.element_size() for p in served.model.parameters())
    assert http.app.state.service.last_activity() == touched
    assert http.get("/v1/usage").status_code == 401


def test_a_retried_seq_returns_the_stored_result_and_runs_once(tiny: str, tmp_path: Path) -> None:
    backend = make_backend(tiny)
    client = Client(serve(backend, tmp_path, keep_results=3))
    request = ForwardBackwardRequest(batch(backend), LossSpec("importance_sampling")).to_dict()
    client.call("forward_backward", {"request": request})
    first = client.post("optim_step", {"params": OPTIM.to_dict()})
    after = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    again = client.post("optim_step", {"params": OPTIM.to_dict()}, seq=2)
    assert first.status_code == again.status_code == 200 and first.json() == again.json() and backend.step == 1
    assert all(torch.equal(p, after[n]) for n, p in backend.model.named_parameters() if p.requires_grad)
    # The same number with other args, a gap, and a number no longer kept are refused, and nothing runs.
    other = client.post("optim_step", {"params": OptimParams(learning_rate=1.0).to_dict()}, seq=2)
    assert other.status_code == 409 and other.json()["error"]["type"] == "sequence"
    gap = client.post("optim_step", {"params": OPTIM.to_dict()}, seq=4)
    assert gap.status_code == 409 and "expected seq 3" in gap.json()["error"]["message"]
    for _ in range(3):
        client.call("logprobs", {"sequences": [[1, 2, 3]]})
    old = client.post("forward_backward", {"request": request}, seq=1)
    assert old.status_code == 409 and "expected seq 6" in old.json()["error"]["message"] and backend.step == 1
    polled = client.http.get(f"/v1/requests/{first.json()['request_id']}", headers=AUTH)
    assert polled.status_code == 404  # forgotten with its seq
    unknown = client.http.post("/v1/call", headers=AUTH, json={"session_id": "0" * 32, "seq": 1, "method": "optim_step", "args": {}})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"


def test_errors_are_stored_outcomes_mapped_to_400_and_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeBackend()
    client = Client(serve(backend, tmp_path))
    backend.fail = ValueError("loss_mask and tokens differ in length")
    bad = client.post("forward_backward", fb_args())
    assert bad.status_code == 400 and bad.json() == {"error": {"type": "invalid_request", "message": "loss_mask and tokens differ in length"}}
    assert client.post("forward_backward", fb_args(), seq=1).json() == bad.json() and len(backend.calls) == 1
    backend.fail = RuntimeError("CUDA error: secret detail")
    with caplog.at_level(logging.ERROR, logger="tinkergym.serve.training.app"):
        crash = client.post("forward_backward", fb_args())
    assert crash.status_code == 500 and "secret detail" not in crash.text and "Traceback" not in crash.text
    assert "secret detail" in caplog.text and "Traceback" in caplog.text
    # A non-finite number travels as Python's json writes it.
    assert math.isnan(json.loads(client.post("optim_step", {"params": OPTIM.to_dict()}).text)["result"]["metrics"]["grad_norm"])


@pytest.mark.parametrize(
    ("method", "args", "expected"),
    [
        ("train", {}, "unknown method"),
        ("forward_backward", {"request": {**fb_args()["request"], "extra": 1}}, "no fields ['extra']"),
        ("forward_backward", {"request": fb_args()["request"], "more": 1}, "unknown: ['more']"),
        ("forward_backward", {"request": {"data": [{"tokens": "abc", "loss_mask": []}]}}, "expected a list"),
        ("forward_backward", {"request": {"data": [{"tokens": [1, True], "loss_mask": [0, 1]}]}}, "expected an integer"),
        ("forward_backward", fb_args([1, 10**9, 2]), "outside the vocabulary"),
        ("sample", {"request": {"prompts": [[-1]]}}, "outside the vocabulary"),
        ("forward_backward", {"request": {"data": [{"tokens": [1, 2], "loss_mask": [0.0, "x"]}]}}, "data[0].loss_mask[1]: expected a number"),
        ("forward_backward", {"request": {"data": [{"tokens": [1, 2.0], "loss_mask": [0.0, 1.0]}]}}, "data[0].tokens[1]: expected an integer"),
        ("optim_step", {"params": {"learning_rate": "1e-3"}}, "expected a number"),
        ("optim_step", {"params": []}, "expected a OptimParams object"),
        ("export", {"name": "e", "merged": "yes"}, "true or false"),
    ],
)
def test_bad_calls_are_400(tmp_path: Path, method: str, args: dict, expected: str) -> None:
    client = Client(serve(FakeBackend(), tmp_path))
    client.http.app.state.service.vocab_size = 1000
    response = client.post(method, args)
    assert response.status_code == 400 and expected in response.json()["error"]["message"], response.text
    assert client.http.app.state.service.backend.calls == []


def test_checked_arguments_take_ints_for_floats_and_to_dict_copies_like_asdict() -> None:
    from dataclasses import asdict

    from tinkergym.serve.training.calls import parse_call
    from tinkergym.protocol.types import SampledSequence, SampleResponse

    call = parse_call("forward_backward", {"request": {"data": [{"tokens": [1, 2], "loss_mask": [0, 1], "advantages": [0.5, 1]}]}})
    datum = call.args["request"].data[0]
    assert datum.loss_mask == [0.0, 1.0] and all(type(v) is float for v in datum.loss_mask + datum.advantages)
    response = SampleResponse([[SampledSequence([1, 2], [-0.5, -1.0], "stop")], [SampledSequence([3], [-2.0], "length")]])
    request = ForwardBackwardRequest([Datum([1, 2, 3], [0.0, 1.0, 1.0])], LossSpec(kl_coef=0.1), num_tokens=2.0)
    for value in (response, request, SamplingParams(stop_token_ids=[5])):
        plain = value.to_dict()
        expected = asdict(value)
        for row in expected.get("data", []):  # a datum without images has no images key on the wire
            assert row.pop("images") == []
        assert plain == expected and type(value).from_dict(plain) == value
    plain = request.to_dict()
    plain["data"][0]["tokens"].append(9)
    assert request.data[0].tokens == [1, 2, 3]


def test_malformed_bodies_are_400(tmp_path: Path) -> None:
    client = Client(serve(FakeBackend(), tmp_path))
    post = lambda **kw: client.http.post("/v1/call", headers=AUTH, **kw)  # noqa: E731
    assert post(content=b"{not json").status_code == 400
    assert post(json={"session_id": client.session, "seq": 1, "method": "x", "args": {}, "pickle": "..."}).status_code == 400
    assert post(json={"session_id": client.session, "seq": 0, "method": "x", "args": {}}).status_code == 400
    assert post(json={"session_id": client.session, "seq": "1", "method": "x", "args": {}}).status_code == 400
    assert client.http.get("/v1/requests/nope?wait=1000", headers=AUTH).json()["error"]["type"] == "invalid_request"


# ----- long calls ------------------------------------------------------------------------------------------
@pytest.fixture
def live_server(tmp_path: Path):
    """A real uvicorn server on 127.0.0.1 serving a FakeBackend whose forward_backward takes 1 s."""
    backend = FakeBackend(delay=1.0)
    app = create_app(backend, run_dir=tmp_path, token_digest=token_digest(TOKEN))
    with serving(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield http, backend


def test_a_call_longer_than_wait_is_202_then_long_polled(live_server) -> None:
    http, backend = live_server
    client = Client(http)
    start = time.monotonic()
    pending = client.post("forward_backward", fb_args(), wait=0.1)
    assert pending.status_code == 202 and time.monotonic() - start < 0.8
    body = pending.json()
    assert body["status"] == "pending" and body["seq"] == 1
    retry = client.post("forward_backward", fb_args(), seq=1, wait=0)  # a retry while it runs: same id, not run again
    assert retry.status_code == 202 and retry.json()["request_id"] == body["request_id"]
    queued = client.post("optim_step", {"params": OPTIM.to_dict()}, wait=0)  # runs after the first, in order
    assert queued.status_code == 202
    done = http.get(f"/v1/requests/{body['request_id']}?wait=5", headers=AUTH)
    assert done.status_code == 200 and done.json() == {**body, "status": "done", "result": {"metrics": {"loss": 0.1 + 0.2}}}
    assert http.get(f"/v1/requests/{queued.json()['request_id']}?wait=5", headers=AUTH).status_code == 200
    assert [name for name, _ in backend.calls] == ["forward_backward", "optim_step"]


# ----- names and files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", "../x", "/etc", "a/b", "", ".hidden", "x.tmp", "a\\b", "x" * 129, 7])
def test_bad_names_are_refused(tmp_path: Path, name: Any) -> None:
    run_dir = tmp_path / "run"
    client = Client(serve(FakeBackend(), run_dir))
    for method in ("save_state", "load_state", "export"):
        response = client.post(method, {"name": name})
        assert response.status_code == 400, (method, response.text)
    assert client.http.app.state.service.backend.calls == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_symlinks_in_the_run_folder_are_not_followed(tmp_path: Path) -> None:
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (run_dir / "states").mkdir(parents=True)
    (run_dir / "states" / "link").symlink_to(outside, target_is_directory=True)
    (run_dir / "states" / "tmplink.tmp").symlink_to(outside, target_is_directory=True)
    client = Client(serve(FakeBackend(), run_dir))
    for method, name in (("save_state", "link"), ("load_state", "link"), ("save_state", "tmplink")):
        response = client.post(method, {"name": name})
        assert response.status_code == 400 and "symbolic link" in response.text
    assert client.post("save_state", {"name": "ok"}).status_code == 200
    assert list(outside.iterdir()) == [] and (run_dir / "states" / "ok" / "state.json").is_file()
    (run_dir / "exports").symlink_to(outside, target_is_directory=True)
    assert client.post("export", {"name": "e"}).status_code == 400


def test_states_and_exports_through_the_server(tiny: str, tmp_path: Path) -> None:
    backend = make_backend(tiny)
    client = Client(serve(backend, tmp_path))
    assert client.call("save_state", {"name": "step-0"}) == {}
    client.call("forward_backward", {"request": ForwardBackwardRequest(batch(backend), LossSpec("reinforce")).to_dict()})
    client.call("optim_step", {"params": OPTIM.to_dict()})
    assert client.call("load_state", {"name": "step-0"}) == {} and backend.step == 0
    missing = client.post("load_state", {"name": "never-saved"})
    assert missing.status_code == 400 and "no saved state" in missing.text
    export = client.call("export", {"name": "adapter", "merged": False})
    names = {f["path"] for f in export["files"]}
    assert export["name"] == "adapter" and {"adapter_config.json", "adapter_model.safetensors"} <= names
    import hashlib

    for entry in export["files"]:
        body = client.http.get(f"/v1/files/exports/adapter/{entry['path']}", headers=AUTH)
        assert body.status_code == 200 and body.headers["content-type"] == "application/octet-stream"
        assert len(body.content) == entry["size"] and hashlib.sha256(body.content).hexdigest() == entry["sha256"]
    (tmp_path / "secret.txt").write_text("TOP-SECRET-CONTENT")
    for path in ("adapter/nope.json", "adapter/..%2F..%2Fsecret.txt", "adapter/%2E%2E/%2E%2E/secret.txt", "..%2Fsecret.txt/x", "adapter/"):
        response = client.http.get(f"/v1/files/exports/{path}", headers=AUTH)
        assert response.status_code in (400, 404) and "TOP-SECRET" not in response.text, path


def test_a_weights_only_load_keeps_the_servers_optimizer_step_and_generator(tiny: str, tmp_path: Path) -> None:
    """``load_state`` with ``weights_only``: the saved adapter's weights, the server's own Adam moments, step and generator."""
    import torch

    backend = make_backend(tiny)
    client = Client(serve(backend, tmp_path))
    data = batch(backend)

    def step() -> None:
        client.call("forward_backward", {"request": ForwardBackwardRequest(data, LossSpec("reinforce")).to_dict()})
        client.call("optim_step", {"params": OPTIM.to_dict()})

    step()
    client.call("save_state", {"name": "one"})
    saved = {n: p.detach().clone() for n, p in backend._trainable}
    step()
    step()
    moments = {k: v.clone() for k, v in backend.optimizer.state_dict()["state"][0].items()}
    rng = torch.get_rng_state()
    client.call("forward_backward", {"request": ForwardBackwardRequest(data, LossSpec("reinforce")).to_dict()})  # pending gradients
    assert client.call("load_state", {"name": "one", "weights_only": True}) == {}
    for name, param in backend._trainable:
        assert torch.equal(param, saved[name]), name
        assert param.grad is None  # a state holds no pending gradients: neither does a weights-only load
    assert backend.step == 3
    for key, value in backend.optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, moments[key]), key
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any((tmp_path / "scratch").iterdir())  # the scratch state is gone
    # a whole load takes the saved optimizer too
    assert client.call("load_state", {"name": "one"}) == {} and backend.step == 1
    bad = client.post("load_state", {"name": "one", "weights_only": "yes"})
    assert bad.status_code == 400 and "weights_only" in bad.text


def test_keep_states_prunes_the_oldest_saved_states(tmp_path: Path) -> None:
    client = Client(serve(FakeBackend(), tmp_path, keep_states=2))
    for step in range(4):
        result = client.call("save_state", {"name": f"step_{step}"})
        os.utime(tmp_path / "states" / f"step_{step}", (1000.0 + step, 1000.0 + step))  # distinct ages on any filesystem
        assert result == ({"pruned": [f"step_{step - 2}"]} if step >= 2 else {})
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["step_2", "step_3"]


def test_tokenizer_files_rebuild_the_same_tokenizer(tiny: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    backend = make_backend(tiny)
    files = serve(backend, tmp_path / "run").get("/v1/tokenizer", headers=AUTH).json()["files"]
    assert "tokenizer.json" in files and not any("/" in name for name in files)
    folder = tmp_path / "client"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    remote = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Place a stone on row 3."}]
    assert remote.get_vocab() == backend.tokenizer.get_vocab()
    assert remote.apply_chat_template(messages, add_generation_prompt=True) == backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert remote.eos_token_id == backend.tokenizer.eos_token_id


# ----- limits ---------------------------------------------------------------------------------------------
def test_bodies_over_the_limit_are_413(tmp_path: Path) -> None:
    client = Client(serve(FakeBackend(), tmp_path, max_body_mb=0.01))
    big = fb_args(list(range(1, 4000)))
    declared = client.post("forward_backward", big)
    assert declared.status_code == 413 and declared.json()["error"]["type"] == "body_too_large"
    payload = json.dumps({"session_id": client.session, "seq": 1, "method": "forward_backward", "args": big}).encode()
    streamed = client.http.post("/v1/call", headers=AUTH, content=iter([payload[i : i + 1000] for i in range(0, len(payload), 1000)]))
    assert streamed.status_code == 413
    assert client.post("forward_backward", fb_args(), seq=1).status_code == 200  # nothing was accepted


SMALL = CallLimits(num_samples=8, new_tokens=200, sequences=32, tokens=1000)


@pytest.mark.parametrize(("method", "args", "limit", "option"), [
    ("sample", {"request": SampleRequest([[1, 2]], num_samples=10**9).to_dict()}, "limit of 8", "--max-num-samples"),
    ("sample", {"request": SampleRequest([[1, 2]], SamplingParams(max_new_tokens=10**9)).to_dict()}, "limit of 200", "--max-request-new-tokens"),
    ("sample", {"request": SampleRequest([[1, 2]] * 5, num_samples=8).to_dict()}, "limit of 32", "--max-request-sequences"),
    ("sample", {"request": SampleRequest([[1] * 100] * 2, SamplingParams(max_new_tokens=64), num_samples=4).to_dict()}, "limit of 1,000",
     "--max-request-tokens"),
    ("forward_backward", {"request": ForwardBackwardRequest([Datum([1, 2], [0.0, 1.0])] * 33, LossSpec("cross_entropy")).to_dict()},
     "limit of 32", "--max-request-sequences"),
    ("forward_backward", fb_args([1] * 1001), "limit of 1,000", "--max-request-tokens"),
    ("logprobs", {"sequences": [[1, 2]] * 33}, "limit of 32", "--max-request-sequences"),
    ("logprobs", {"sequences": [[1] * 600, [2] * 401]}, "limit of 1,000", "--max-request-tokens"),
])
def test_calls_over_a_limit_are_refused_before_the_backend_sees_them(tmp_path: Path, method: str, args: dict, limit: str, option: str) -> None:
    """Sizes a request can ask for are bounded from its numbers alone (num_samples=10**9 grew a server by gigabytes)."""
    backend = FakeBackend()
    client = Client(serve(backend, tmp_path, limits=SMALL))
    refused = client.post(method, args)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert limit in message and option in message and "/v1/info" in message
    assert backend.calls == []
    assert client.post(method, args, seq=client.seq).json() == refused.json()  # a stored outcome: a retry gets the same answer
    assert client.post("forward_backward", fb_args()).status_code == 200 and len(backend.calls) == 1


def test_calls_within_the_limits_run_and_the_limits_are_listed(tmp_path: Path) -> None:
    backend = FakeBackend()
    http = serve(backend, tmp_path, limits=SMALL)
    assert http.get("/v1/info", headers=AUTH).json()["limits"] == {
        "max_num_samples": 8, "max_new_tokens": 200, "max_sequences": 32, "max_tokens": 1000}
    client = Client(http)
    assert client.post("forward_backward", {"request": ForwardBackwardRequest([Datum([1] * 500, [1.0] * 500)] * 2, LossSpec("cross_entropy")).to_dict()}).status_code == 200
    assert [name for name, _ in backend.calls] == ["forward_backward"]


def test_serve_backend_passes_its_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import secrets

    from tinkergym.serve.training import app as server
    from tinkergym.backends.torch import backend as torch_backend

    class Built(Exception):
        pass

    def fake_create_app(backend: Any, **options: Any) -> None:
        raise Built(options["limits"])

    monkeypatch.setattr(torch_backend, "TorchBackend", lambda config: FakeBackend())
    monkeypatch.setattr(server, "create_app", fake_create_app)
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    args = ["serve", "backend", "--model", "tiny", "--token-file", str(token), "--run-dir", str(tmp_path / "server")]
    flags = ["--max-num-samples", "3", "--max-request-new-tokens", "5", "--max-request-sequences", "7", "--max-request-tokens", "11"]
    built = CliRunner().invoke(main, args + flags).exception
    assert isinstance(built, Built) and built.args[0] == CallLimits(num_samples=3, new_tokens=5, sequences=7, tokens=11)
    default = CliRunner().invoke(main, args).exception
    assert isinstance(default, Built) and default.args[0] == CallLimits()
    refused = CliRunner().invoke(main, args + ["--max-num-samples", "0"])
    assert refused.exit_code == 2 and "--max-num-samples" in refused.output


def test_serve_backend_builds_its_backend_on_the_thread_that_runs_its_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread runs all of a server's torch work: a CPU process with two threads' OpenMP teams decodes 1.7x slower."""
    import secrets
    import threading

    from tinkergym.serve.training import app as server
    from tinkergym.backends.torch import backend as torch_backend

    built_on: list[threading.Thread] = []

    class Built(Exception):
        pass

    def build(config: Any) -> FakeBackend:
        built_on.append(threading.current_thread())
        return FakeBackend()

    def fake_create_app(backend: Any, **options: Any) -> None:
        raise Built(backend, options["worker"])

    monkeypatch.setattr(torch_backend, "TorchBackend", build)
    monkeypatch.setattr(server, "create_app", fake_create_app)
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    built = CliRunner().invoke(main, ["serve", "backend", "--model", "tiny", "--token-file", str(token), "--run-dir", str(tmp_path / "server")]).exception
    assert isinstance(built, Built)
    backend, worker = built.args
    try:
        assert isinstance(backend, FakeBackend) and worker.backend is backend
        assert built_on != [threading.current_thread()] and built_on == [worker.run(threading.current_thread)]
    finally:
        worker.stop()


def test_a_worker_runs_functions_in_order_with_its_calls_and_raises_what_they_raise(tmp_path: Path) -> None:
    import threading

    from tinkergym.serve.training.calls import CallWorker

    worker = CallWorker.building(lambda: FakeBackend(), tmp_path, logging.getLogger("test"))
    try:
        assert isinstance(worker.backend, FakeBackend) and worker.snapshots.keep == 8
        seen: list[int] = []
        release = threading.Event()
        first = threading.Thread(target=worker.run, args=(lambda: (release.wait(10), seen.append(1)),))
        first.start()
        time.sleep(0.05)  # the first function holds the thread: the second waits behind it
        second = threading.Thread(target=worker.run, args=(lambda: seen.append(2),))
        second.start()
        time.sleep(0.05)
        assert seen == []
        release.set()
        first.join(10)
        second.join(10)
        assert seen == [1, 2]
        with pytest.raises(ZeroDivisionError):
            worker.run(lambda: 1 / 0)
        assert worker.run(lambda: worker.run(lambda: 7)) == 7  # from its own thread a function runs at once
    finally:
        worker.stop()
    with pytest.raises(RuntimeError, match="no backend"):
        CallWorker.building(lambda: (_ for _ in ()).throw(RuntimeError("no backend")), tmp_path, logging.getLogger("test"))


# ----- the command ----------------------------------------------------------------------------------------
def test_serve_backend_refuses_to_start_without_a_private_token_file(tmp_path: Path) -> None:
    args = ["serve", "backend", "--model", "tiny", "--run-dir", str(tmp_path / "run")]
    missing = CliRunner().invoke(main, args)
    assert missing.exit_code == 2 and "--token-file is required" in missing.output
    token = tmp_path / "token.txt"
    token.write_text(TOKEN)
    token.chmod(0o644)
    readable = CliRunner().invoke(main, [*args, "--token-file", str(token)])
    assert readable.exit_code == 2 and "chmod 600" in readable.output
    token.write_text("short")
    token.chmod(0o600)
    short = CliRunner().invoke(main, [*args, "--token-file", str(token)])
    assert short.exit_code == 2 and "at least 32 characters" in short.output
    assert not (tmp_path / "run").exists()
