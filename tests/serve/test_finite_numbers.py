"""Every number on every server's wire is finite and in its range: NaN, infinities and numbers past a float (``1e999``)
are answered 400 with the field's name, before any route computes with them, and a finite number out of its range
(a temperature of 1e30, a loss scale of 1e38, an advantage of 1e38) is 400 too.

The scheduler's and the inference server's fields are found by walking their OpenAPI documents (every number of every
JSON body); the training servers type a call's ``args`` as any object, so their fields are found by walking the
protocol's request dataclasses. The Tinker front door's are in tests/tinker_api/test_sdk.py.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from fastapi.testclient import TestClient

from tinkergym.backends.serving import plan_serving
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.inference import TorchInferenceEngine
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams
from tinkergym.scheduler.app import SchedulerSettings, create_app as create_scheduler
from tinkergym.scheduler.auth import create_key
from tinkergym.scheduler.credentials import WorkerBounds, create_worker_key
from tinkergym.scheduler.db import make_engine, upgrade
from tinkergym.serve.auth import token_digest
from tinkergym.serve.inference.app import create_inference_app
from tinkergym.serve.training.app import create_app as create_training

TOKEN = "finite-" + "t" * 40
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
#: The texts of numbers that are not finite, as Python's json writes and reads them (1e999 reads as infinity).
NOT_FINITE = ("NaN", "Infinity", "-Infinity", "1e999")


def number_fields(schema: dict[str, Any], node: dict[str, Any], at: tuple = (), seen: frozenset = frozenset()) -> list[tuple]:
    """The paths (keys; 0 for a list's item) of every number in a JSON schema ``node``, $refs and unions followed."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return [] if name in seen else number_fields(schema, schema["components"]["schemas"][name], at, seen | {name})
    found: list[tuple] = []
    for option in node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", []):
        found += number_fields(schema, option, at, seen)
    if node.get("type") == "number":
        found.append(at)
    for key, child in node.get("properties", {}).items():
        found += number_fields(schema, child, (*at, key), seen)
    if isinstance(node.get("items"), dict):
        found += number_fields(schema, node["items"], (*at, 0), seen)
    return sorted(set(found), key=str)


def body_with(path: tuple, number: str) -> str:
    """A JSON body holding ``number`` (its text) at ``path`` and nothing else."""
    value: Any = "@@"
    for key in reversed(path):
        value = [value] if key == 0 else {key: value}
    return json.dumps(value).replace('"@@"', number)


def json_bodies(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(method, path, body schema)`` of every operation of an OpenAPI document that takes a JSON body."""
    return [(method, path, op["requestBody"]["content"]["application/json"]["schema"])
            for path, item in schema["paths"].items() for method, op in item.items()
            if "application/json" in op.get("requestBody", {}).get("content", {})]


def assert_refused(response: Any, field: str) -> None:
    assert response.status_code == 400, (field, response.status_code, response.text[:300])
    assert field in response.text and "finite" in response.text, (field, response.text[:300])


def test_the_scheduler_refuses_a_number_that_is_not_finite_in_every_field_of_its_document(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'scheduler.db'}"
    engine = make_engine(url)
    upgrade(engine)
    admin = {"Authorization": "Bearer " + create_key(engine, "acme", ["admin"])[1], "Content-Type": "application/json"}
    worker = {"Authorization": "Bearer " + create_worker_key(engine, WorkerBounds(4))[1], "Content-Type": "application/json"}
    engine.dispose()
    app = create_scheduler(SchedulerSettings(db_url=url, data_dir=tmp_path / "data"), background=False)
    with TestClient(app) as http:
        schema = http.get("/openapi.json", headers=admin).json()
        checked = 0
        for method, path, body in json_bodies(schema):
            url_path = path.replace("{", "").replace("}", "")  # any id: the body is refused before the route looks
            headers = worker if path.startswith("/v1/workers") else admin
            for field in number_fields(schema, body):
                for number in NOT_FINITE:
                    response = http.request(method.upper(), url_path, content=body_with(field, number), headers=headers)
                    assert_refused(response, str(field[-1]))
                    checked += 1
        assert checked >= 3 * len(NOT_FINITE), checked  # the walk found the document's numbers (the quotas, a device's memory, ...)
        # A job config is free-form JSON: a NaN inside it is refused the same way, by its path.
        response = http.post("/v1/jobs", content='{"kind": "train", "config": {"model": "tiny", "lr": NaN}}', headers=admin)
        assert_refused(response, "the body.config.lr")


def test_the_inference_server_refuses_a_number_that_is_not_finite_in_every_field_of_its_document(tiny: str) -> None:
    engine = TorchInferenceEngine(plan_serving(model=tiny, adapters=[]), device="cpu", max_model_len=64)
    with TestClient(create_inference_app(engine, token_digest(TOKEN))) as http:
        schema = http.get("/openapi.json", headers=HEADERS).json()
        checked = 0
        for method, path, body in json_bodies(schema):
            for field in number_fields(schema, body):
                for number in NOT_FINITE:
                    assert_refused(http.request(method.upper(), path, content=body_with(field, number), headers=HEADERS), str(field[-1]))
                    checked += 1
        assert checked >= 2 * len(NOT_FINITE), checked


# ----- the training server -------------------------------------------------------------------------------------
def float_fields(cls: type, at: tuple = ()) -> list[tuple]:
    """The paths of every float of a protocol request dataclass (0 for a list's item), nested dataclasses followed."""
    found: list[tuple] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        options = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (typing.Union, type(int | None)) else [hint]
        for option in options:
            if option is float:
                found.append((*at, f.name))
            elif typing.get_origin(option) is list and typing.get_args(option)[0] is float:
                found.append((*at, f.name, 0))
            elif typing.get_origin(option) is list and dataclasses.is_dataclass(typing.get_args(option)[0]):
                found += float_fields(typing.get_args(option)[0], (*at, f.name, 0))
            elif isinstance(option, type) and dataclasses.is_dataclass(option):
                found += float_fields(option, (*at, f.name))
    return found


VALID: dict[str, dict[str, Any]] = {
    "sample": {"request": SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=2, seed=1)).to_dict()},
    "forward_backward": {"request": ForwardBackwardRequest(
        [Datum([5, 6, 7], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])], LossSpec("ppo"), num_tokens=2.0,
    ).to_dict()},
    "optim_step": {"params": OptimParams(learning_rate=1e-3).to_dict()},
}
REQUESTS = {"sample": SampleRequest, "forward_backward": ForwardBackwardRequest, "optim_step": OptimParams}


def replaced(value: Any, path: tuple, new: str) -> Any:
    """``value`` (JSON data) with the item at ``path`` replaced by the marker ``new`` (every item, for a list's 0)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if key == 0:
        return [replaced(item, rest, new) for item in value]
    return {**value, key: replaced(value.get(key, 0.0 if not rest else {}), rest, new)}


@pytest.fixture(scope="module")
def training(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", device="cpu", lora_rank=4, micro_batch_size=4, seed=3))
    with TestClient(create_training(backend, run_dir=tmp_path_factory.mktemp("run"), token_digest=token_digest(TOKEN))) as http:
        yield http


def call(http: TestClient, method: str, body: str) -> Any:
    session = http.post("/v1/sessions", headers=HEADERS).json()["session_id"]
    text = f'{{"session_id": "{session}", "seq": 1, "method": "{method}", "args": {body}}}'
    return http.post("/v1/call?wait=60", headers=HEADERS, content=text)


def test_the_training_server_refuses_nan_in_every_float_of_its_protocol(training: TestClient) -> None:
    checked = 0
    for method, cls in REQUESTS.items():
        key = "params" if method == "optim_step" else "request"
        for field in float_fields(cls):
            args = {key: replaced(VALID[method][key], field, "@@")}
            response = call(training, method, json.dumps(args).replace('"@@"', "NaN"))
            assert response.status_code == 400 and "NaN" in response.text, (method, field, response.text[:300])
            assert str(field[-1] if field[-1] != 0 else field[-2]) in response.text, (method, field, response.text[:300])
            checked += 1
    assert checked >= 20, checked
    assert call(training, "logprobs", '{"sequences": [[5, 6]], "temperature": NaN}').status_code == 400


@pytest.mark.parametrize(("method", "field", "value", "named"), [
    ("sample", ("params", "temperature"), 1e30, "temperature"),
    ("sample", ("params", "temperature"), float("inf"), "temperature"),
    ("sample", ("params", "temperature"), -1.0, "temperature"),
    ("sample", ("params", "top_p"), 0.0, "top_p"),
    ("sample", ("params", "top_p"), 2.0, "top_p"),
    ("forward_backward", ("loss", "loss_scale"), 1e38, "loss_scale"),
    ("forward_backward", ("loss", "loss_scale"), float("inf"), "loss_scale"),
    ("forward_backward", ("loss", "kl_coef"), float("inf"), "kl_coef"),
    ("forward_backward", ("data", 0, "advantages", 0), 1e38, "advantages"),
    ("forward_backward", ("data", 0, "loss_mask", 0), float("inf"), "loss_mask"),
    ("forward_backward", ("data", 0, "sampling_logprobs", 0), float("-inf"), "sampling_logprobs"),
    ("forward_backward", ("num_tokens",), float("inf"), "num_tokens"),
    ("forward_backward", ("num_tokens",), -1.0, "num_tokens"),
])
def test_the_training_server_refuses_a_number_out_of_its_range(training: TestClient, method: str, field: tuple, value: float, named: str) -> None:
    args = {"request": replaced(VALID[method]["request"], field, "@@")}
    response = call(training, method, json.dumps(args).replace('"@@"', json.dumps(value)))
    assert response.status_code == 400 and named in response.text, response.text[:300]
    assert call(training, method, json.dumps(VALID[method])).status_code == 200  # and the server goes on


def test_logprobs_refuses_a_temperature_out_of_its_range(training: TestClient) -> None:
    for value in ("0", "-1", "1e30", "Infinity"):
        response = call(training, "logprobs", f'{{"sequences": [[5, 6]], "temperature": {value}}}')
        assert response.status_code == 400 and "temperature" in response.text, (value, response.text[:300])


@pytest.mark.parametrize("values", [[1.0, float("nan"), 0.5], [float("nan"), 1.0, 1.0], [0.5, float("inf"), 0.5], [1.0, 1.0, 1e7]])
def test_a_backend_in_process_refuses_what_the_wire_would(values: list[float]) -> None:
    """TorchBackend's own checks (no server between: a local run) refuse a NaN wherever it stands in a datum's
    numbers (``max`` alone steps over one), an infinity and an entry past the bound."""
    from tinkergym.backends.torch.batches import validate_data
    from tinkergym.errors import ConfigError

    with pytest.raises(ConfigError, match="advantages holds"):
        validate_data([Datum([1, 2, 3], [0.0, 1.0, 1.0], values, [-1.0] * 3)], LossSpec("ppo"))
    validate_data([Datum([1, 2, 3], [0.0, 1.0, 1.0], [0.5, -0.5, 1e6], [-1.0] * 3)], LossSpec("ppo"))  # the bound itself is in
