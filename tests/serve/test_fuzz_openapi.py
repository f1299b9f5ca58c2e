"""Hostile input: schemathesis generates requests for every operation of the OpenAPI documents of the training server
(``tinkergym serve backend``) and the inference server (``tinkergym serve model``), each built in-process around the
tiny model and called with its bearer token. Neither answers any of them with a 5xx, and every answer is what the
document declares: its status code, content type and body schema.

The documents type a call's ``args`` as any object and a completion's ``model`` as any string, so the fuzzer alone
would meet nothing but unknown sessions and models. Half of the generated requests therefore start from a valid one
(a fresh session, a served model, a kept request id) with up to three of its values replaced, mostly by values of the
same JSON type (extremes, empty lists, huge integers, NaN), or removed. The tests after the two runs pin each class of
5xx that such runs found, each with the smallest request that showed it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("torch")

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tinkergym.backends.serving import plan_serving
from tinkergym.backends.torch.inference import TorchInferenceEngine
from tinkergym.serve.inference.app import create_inference_app
from tinkergym.serve.training.app import create_app
from tinkergym.serve.training.calls import CallLimits
from tinkergym.serve.auth import token_digest
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from tinkergym.errors import NonFiniteError

TOKEN = "fuzz-" + "t" * 40
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: Small enough that no generated call holds the model for long on a CPU.
LIMITS = CallLimits(num_samples=4, new_tokens=8, sequences=16, tokens=4096)

#: One valid call of each method; the fuzzer sends them with some values changed.
CALLS: dict[str, dict[str, Any]] = {
    "sample": {"request": SampleRequest([[5, 6, 7], [8]], SamplingParams(max_new_tokens=3, seed=1, stop_token_ids=[4]), num_samples=2).to_dict()},
    "logprobs": {"sequences": [[5, 6, 7], [8, 9]], "temperature": 0.7},
    "forward_backward": {"request": ForwardBackwardRequest(
        [Datum([5, 6, 7], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])],
        LossSpec("ppo", kl_coef=0.1, old_logprobs="trainer", tis_cap=2.0), num_tokens=2.0, num_sequences=1,
    ).to_dict()},
    "optim_step": {"params": OptimParams(learning_rate=1e-3).to_dict()},
    "save_state": {"name": "s1"},
    "load_state": {"name": "s0"},
    "export": {"name": "e1", "merged": False},
}

#: Strict JSON, as schemathesis sends it: NaN and infinities are left to the tests below, which send them as Python writes them.
NUMBERS = st.floats(allow_nan=False, allow_infinity=False)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | NUMBERS | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def like(value: Any) -> st.SearchStrategy:
    """Values of ``value``'s JSON type three times in four (an int's place gets any integer), else any JSON."""
    if isinstance(value, bool):
        same = st.booleans()
    elif isinstance(value, int):
        same = st.integers()
    elif isinstance(value, float):
        same = NUMBERS | st.integers()
    elif isinstance(value, str):
        same = st.text(max_size=12)
    elif isinstance(value, list):
        same = st.lists(like(value[0]) if value else ANY_JSON, max_size=5)
    else:
        same = ANY_JSON
    return st.one_of(same, same, same, ANY_JSON)


def places(value: Any, at: tuple = ()) -> list[tuple]:
    """The path of every value nested in ``value`` (keys and list indexes), ``value`` itself excluded."""
    found = []
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found += [at + (key,), *places(child, at + (key,))]
    return found


@st.composite
def near(draw: Any, valid: Any) -> Any:
    """``valid`` with up to three of its values replaced (by :func:`like`) or, in an object, removed."""
    value = copy.deepcopy(valid)
    for _ in range(draw(st.integers(0, 3))):
        spots = places(value)
        if not spots:
            break
        at = draw(st.sampled_from(spots))
        parent = value
        for key in at[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.integers(0, 3)) == 0:
            del parent[at[-1]]
        else:
            parent[at[-1]] = draw(like(parent[at[-1]]))
    return value


def fuzz(schema: Any, examples: dict[str, int], real: Any, seen: Any = None, headers: dict[str, str] = HEADERS) -> tuple[list[str], list[tuple[str, int]]]:
    """One Hypothesis run per operation (schemathesis' pytest plugin does the same through parametrize); ``real(case, draw)``
    turns half of the cases into near-valid ones, ``seen(case, response)`` sees every answer. Failures are gathered, so
    every operation is fuzzed before the test fails."""
    failures, statuses = [], []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(), make_real=st.booleans(), data=st.data())
        @settings(max_examples=examples.get(operation.path, 30), deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case: Any, make_real: bool, data: Any) -> None:
            if make_real:
                real(case, data.draw)
            response = case.call_and_validate(headers=headers, checks=CHECKS)
            statuses.append((operation.path, response.status_code))  # noqa: B023 - run within this iteration
            if seen is not None:
                seen(case, response)

        try:
            run()
        except Exception as exc:  # noqa: BLE001 - gathered
            failures.append(f"{operation.label}: {str(exc)[:1500]}")
    return failures, statuses


# ----- the training server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def training(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The training server's app on the tiny model, with a saved state ``s0`` and an export ``e0`` to meet."""
    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", device="cpu", lora_rank=4, micro_batch_size=4, seed=3))
    app = create_app(backend, run_dir=tmp_path_factory.mktemp("fuzz-run"), token_digest=token_digest(TOKEN), limits=LIMITS)
    with TestClient(app) as http:
        for name, args in (("save_state", {"name": "s0"}), ("export", {"name": "e0"})):
            assert call(http, name, args).status_code == 200
        yield http


def call(http: TestClient, method: str, args: Any) -> Any:
    """``method`` with JSON ``args`` (NaN and huge integers as Python writes them) as call 1 of a fresh session."""
    session = http.post("/v1/sessions", headers=HEADERS).json()["session_id"]
    body = json.dumps({"session_id": session, "seq": 1, "method": method, "args": args})
    return http.post("/v1/call?wait=60", headers={**HEADERS, "Content-Type": "application/json"}, content=body)


@pytest.mark.slow
def test_no_request_makes_the_training_server_fail(training: TestClient) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", training.app, headers=HEADERS)
    request_ids, files = [], [f["path"] for f in call(training, "export", {"name": "e0"}).json()["result"]["files"]]

    def real(case: Any, draw: Any) -> None:
        if case.operation.path == "/v1/call":
            method = draw(st.sampled_from(sorted(CALLS)))
            session = training.post("/v1/sessions", headers=HEADERS).json()["session_id"]
            case.body = {"session_id": session, "seq": 1, "method": method, "args": draw(near(CALLS[method]))}
        elif case.operation.path == "/v1/requests/{request_id}" and request_ids:  # the fuzzed calls' ids, kept or forgotten
            case.path_parameters = {"request_id": draw(st.sampled_from(request_ids))}
        elif case.operation.path.startswith("/v1/files/exports/"):
            case.path_parameters = {"name": "e0", "path": draw(st.sampled_from(files) | st.text(max_size=20))}

    def seen(case: Any, response: Any) -> None:
        answer = response.json() if response.headers.get("content-type", [""])[0].startswith("application/json") else None
        if not isinstance(answer, dict):
            return
        if case.operation.path == "/v1/call" and "request_id" in answer:  # gathered before the polls are fuzzed
            request_ids.append(answer["request_id"])
        if (answer.get("error") or {}).get("type") == "NonFiniteError":  # a step that diverged (409): go on from s0
            assert call(training, "load_state", {"name": "s0"}).status_code == 200

    failures, statuses = fuzz(schema, {"/v1/call": 150}, real, seen)
    assert call(training, "load_state", {"name": "s0"}).status_code == 200  # the tests below start from s0's weights
    assert not failures, "\n\n".join(failures)
    assert len(statuses) >= 200 and {("/v1/call", 200), ("/v1/call", 400), ("/v1/call", 404)} <= set(statuses), sorted(set(statuses))


@pytest.mark.slow
def test_no_request_makes_the_shared_server_fail(tiny: str, tmp_path: Path) -> None:
    """The shared server's document fuzzed with the server's token (its adapter routes) and with an adapter's (the rest)."""
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.serve.training.shared import create_shared_app

    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", max_sessions=8))
    app = create_shared_app(base, run_dir=tmp_path, token_digest=token_digest(TOKEN), limits=LIMITS)
    with TestClient(app) as http:
        adapter = http.post("/v1/adapters", headers=HEADERS, json={"adapter_id": "a0", "lora_rank": 4}).json()
        mine = {"Authorization": f"Bearer {adapter['token']}"}  # the adapter the near-valid calls go to
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=HEADERS)

        def real(case: Any, draw: Any) -> None:
            if case.operation.path == "/v1/adapters" and case.method.upper() == "POST":
                case.body = draw(near({"lora_rank": 4, "lora_alpha": 8.0, "seed": 1, "source": {"adapter_id": "a0", "export": "e0"}}))
            elif case.operation.path.startswith("/v1/adapters/{"):
                case.path_parameters = {"adapter_id": draw(st.sampled_from(["a0", "nope", "..", "a0\x00"]))}
            elif case.operation.path == "/v1/call":
                method = draw(st.sampled_from(sorted(CALLS)))
                session = http.post("/v1/sessions", headers=mine).json().get("session_id", "closed")  # the fuzzer may have closed it
                case.body = {"session_id": session, "seq": 1, "method": method, "args": draw(near(CALLS[method]))}

        admin_failures, admin_statuses = fuzz(schema, {}, real)
        # The fuzzer may have closed a0: the adapter's half runs with a fresh adapter.
        mine = {"Authorization": f"Bearer {http.post('/v1/adapters', headers=HEADERS, json={}).json()['token']}"}
        adapter_failures, adapter_statuses = fuzz(schema, {"/v1/call": 60}, real, headers=mine)
    assert not admin_failures + adapter_failures, "\n\n".join(admin_failures + adapter_failures)
    assert {("/v1/adapters", 201), ("/v1/adapters", 400)} <= set(admin_statuses), sorted(set(admin_statuses))
    assert {("/v1/call", 400), ("/v1/adapters", 403)} <= set(adapter_statuses), sorted(set(adapter_statuses))
    # a valid call was taken: done (200) or, where the fuzzed ``wait`` ran out first, still running (202)
    assert {("/v1/call", 200), ("/v1/call", 202)} & set(adapter_statuses), sorted(set(adapter_statuses))


@pytest.mark.parametrize(("method", "args"), [
    ("logprobs", {"sequences": [[5, 6], []]}),
    ("forward_backward", {"request": {"data": [{"tokens": [], "loss_mask": []}], "loss": {"name": "cross_entropy"}}}),
    ("sample", {"request": {"prompts": [[5], []], "params": {"max_new_tokens": 2}}}),
])
def test_a_sequence_without_tokens_is_400(training: TestClient, method: str, args: dict) -> None:
    response = call(training, method, args)
    assert response.status_code == 400 and "has no tokens" in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("seed", [[], "1", 1.5, {}])
def test_a_value_that_fits_no_option_of_an_optional_field_is_400(training: TestClient, seed: Any) -> None:
    params = {**CALLS["sample"]["request"]["params"], "seed": seed}
    response = call(training, "sample", {"request": {**CALLS["sample"]["request"], "params": params}})
    assert response.status_code == 400 and "args.request.params.seed" in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(("method", "args", "where"), [
    ("logprobs", {"sequences": [[5, 6]], "temperature": 10**400}, "args.temperature"),
    ("sample", {"request": {"prompts": [[5]], "params": {"max_new_tokens": 2, "top_p": -(10**400)}}}, "args.request.params.top_p"),
    ("forward_backward", {"request": {**CALLS["forward_backward"]["request"], "num_tokens": 10**400}}, "args.request.num_tokens"),
])
def test_an_integer_too_large_for_a_float_is_400(training: TestClient, method: str, args: dict, where: str) -> None:
    response = call(training, method, args)
    assert response.status_code == 400 and f"{where}: " in response.json()["error"]["message"] and "too large" in response.text, response.text


@pytest.mark.parametrize(("name", "value"), [
    ("learning_rate", float("nan")), ("learning_rate", -1.0), ("learning_rate", float("inf")), ("beta1", 1.0), ("beta2", -0.5),
    ("beta1", 3.9e84), ("eps", 0.0), ("eps", -1.0), ("weight_decay", float("nan")), ("max_grad_norm", -1.0),
])
def test_optimizer_settings_out_of_adamw_bounds_are_400_and_leave_the_weights_finite(training: TestClient, name: str, value: float) -> None:
    assert call(training, "forward_backward", CALLS["forward_backward"]).status_code == 200
    response = call(training, "optim_step", {"params": {**CALLS["optim_step"]["params"], name: value}})
    message = response.json()["error"]["message"]  # NaN is refused at the door, before the setting's own check
    assert response.status_code == 400 and (f"args.params.{name} must be" in message or f"args.params.{name} is NaN" in message), response.text
    assert call(training, "optim_step", CALLS["optim_step"]).status_code == 200
    assert call(training, "sample", CALLS["sample"]).status_code == 200


@pytest.mark.parametrize(("name", "value"), [("clip_low", 1e308), ("clip_high", 1e39), ("tis_cap", 1e308), ("loss_scale", -1e300), ("kl_coef", float("nan"))])
def test_loss_settings_beyond_float32_are_400(training: TestClient, name: str, value: float) -> None:
    request = CALLS["forward_backward"]["request"]
    response = call(training, "forward_backward", {"request": {**request, "loss": {**request["loss"], name: value}}})
    message = response.json()["error"]["message"]  # NaN is refused at the door, before the loss's own check
    assert response.status_code == 400 and ((f"{name}=" in message and "float32" in message) or f"loss.{name} is NaN" in message), response.text


def test_an_infinite_bound_still_means_no_bound(training: TestClient) -> None:
    """Only NaN and finite numbers past float32 are refused: clip_high, tis_cap and max_grad_norm at infinity bound nothing."""
    request = CALLS["forward_backward"]["request"]
    for name in ("clip_high", "tis_cap"):
        assert call(training, "forward_backward", {"request": {**request, "loss": {**request["loss"], name: float("inf")}}}).status_code == 200
    assert call(training, "optim_step", {"params": {**CALLS["optim_step"]["params"], "max_grad_norm": float("inf")}}).status_code == 200


def test_diverged_weights_are_409_and_a_saved_state_brings_the_server_back(tmp_path: Path) -> None:
    """A step whose numbers diverge is the model's state, not a server fault: 409 with the error's type, as the client reads it."""

    class Diverging:
        def info(self) -> dict[str, Any]:
            return {"model": "fake"}

        def optim_step(self, params: Any) -> dict[str, float]:
            raise NonFiniteError("optimizer step 1 made weights NaN or infinite (learning rate 1e+30)")

    app = create_app(Diverging(), run_dir=tmp_path, token_digest=token_digest(TOKEN))
    response = call(TestClient(app), "optim_step", {"params": {"learning_rate": 1e30}})
    assert response.status_code == 409 and response.json()["error"]["type"] == "NonFiniteError", response.text
    assert "load_state" in response.json()["error"]["message"]


# ----- the inference server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inference(tiny: str) -> Any:
    """The inference server's app on the tiny model (a short context, so no completion runs long) and its valid requests."""
    engine = TorchInferenceEngine(plan_serving(model=tiny, adapters=[]), device="cpu", max_model_len=64)
    valid = {
        "/v1/completions": [
            {"model": tiny, "prompt": "hello there", "max_tokens": 4, "temperature": 0.7, "logprobs": 1, "n": 2, "seed": 1,
             "stop_token_ids": [5], "return_tokens_as_token_ids": True},
            {"model": tiny, "prompt": [[5, 6, 7], [8]], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
             "logprobs": 0, "top_k": 4, "ignore_eos": True},
        ],
        "/v1/chat/completions": [
            {"model": tiny, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 1, "top_p": 0.9},
            {"model": tiny, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "n": 2, "seed": 3},
        ],
    }
    with TestClient(create_inference_app(engine, token_digest(TOKEN))) as http:
        yield http, valid


@pytest.mark.slow
def test_no_request_makes_the_inference_server_fail(inference: Any) -> None:
    http, valid = inference
    schema = schemathesis.openapi.from_asgi("/openapi.json", http.app, headers=HEADERS)

    def real(case: Any, draw: Any) -> None:
        if case.operation.path in valid:
            case.body = draw(near(draw(st.sampled_from(valid[case.operation.path]))))

    failures, statuses = fuzz(schema, {"/v1/completions": 100, "/v1/chat/completions": 100}, real)
    assert not failures, "\n\n".join(failures)
    for path in valid:
        assert {(path, 200), (path, 400), (path, 404)} <= set(statuses), sorted(set(statuses))


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/v1/completions", '{"model": "M", "prompt": "hi\\ud800", "max_tokens": 2}', "body.prompt"),
    ("/v1/completions", '{"model": "M", "prompt": ["a", "\\udfff"], "max_tokens": 2}', "body.prompt[1]"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "body.messages[0].content"),
])
def test_a_lone_surrogate_in_text_is_400_in_openai_shape(inference: Any, path: str, body: str, where: str) -> None:
    http, valid = inference
    response = http.post(path, headers={**HEADERS, "Content-Type": "application/json"}, content=body.replace("M", valid[path][0]["model"]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and where in error["message"] and "surrogate" in error["message"]


@pytest.mark.parametrize("part", [{"type": "text", "text": 5}, {"type": "text", "text": ["a"]}, {"text": "no type"}, "a string"])
def test_a_malformed_content_part_is_400(inference: Any, part: Any) -> None:
    http, valid = inference
    body = {**valid["/v1/chat/completions"][0], "messages": [{"role": "user", "content": [part]}]}
    response = http.post("/v1/chat/completions", headers=HEADERS, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages.0.content"), response.text


def test_the_document_declares_refusals_and_event_streams(inference: Any) -> None:
    """The answers the fuzz checks against the document: refusals in OpenAI's shape, server-sent events with ``stream``."""
    http, _ = inference
    paths = http.get("/openapi.json", headers=HEADERS).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = paths[path]["post"]["responses"]
        assert set(answers) == {"200", "4XX"} and "text/event-stream" in answers["200"]["content"], answers
        assert answers["4XX"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


def test_a_refused_token_is_answered_in_the_documented_error_shape(training: TestClient) -> None:
    from tinkergym.serve.training.app import ErrorResponse

    for headers in ({}, {"Authorization": "Bearer " + "x" * 40}):
        response = training.get("/v1/info", headers=headers)
        assert response.status_code == 401
        assert ErrorResponse.model_validate(response.json()).error.type == "unauthorized"
