"""The inference server: training to inference without code change, adapters, the OpenAI client, auth and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from testkit import free_port, exited_output, wait_until_answers  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.backends.serving import plan_serving
from tinkergym.backends.torch.inference import TorchInferenceEngine
from tinkergym.serve.inference.app import create_inference_app
from tinkergym.backends.models import build_tiny_model
from tinkergym.serve.auth import token_digest
from tinkergym.cli import main

KEY = "k" * 20 + "-inference-server-test-key"
EVAL = ("--env", "tinker/Bandit-v0", "--episodes", "4", "--max-new-tokens", "6", "--max-turns", "2")


def _train(tiny: str, out: Path, *extra: str) -> Path:
    args = [
        "train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--batch-size", "2", "--group-size", "4",
        "--max-new-tokens", "6", "--lr", "3e-2", "--checkpoint-every", "1", "--quiet", "--out", str(out), *extra,
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    tiny = build_tiny_model(root / "model")
    key_file = root / "key.txt"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    run_a = _train(tiny, root / "run_a", "--steps", "2", "--seed", "1")
    run_b = _train(tiny, root / "run_b", "--steps", "3", "--seed", "2")
    checkpoint_b = sorted((run_b / "checkpoints").iterdir())[-1]
    # One adapter from a run folder (its final/ export), the other from a checkpoint folder.
    plan = plan_serving(model=tiny, adapters=[("a", str(run_a)), ("b", str(checkpoint_b))])
    engine = TorchInferenceEngine(plan)
    app = create_inference_app(engine, token_digest(KEY))
    server = ThreadServer(app)
    yield {"root": root, "tiny": tiny, "key_file": key_file, "runs": {"a": run_a, "b": run_b}, "app": app, "url": server.url, "engine": engine}
    server.stop()


def _eval(*args: str, out: Path):
    result = CliRunner().invoke(main, ["eval", *EVAL, *args, "--out", str(out), "--json"], catch_exceptions=False)
    return result, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_served_plan_is_the_base_and_its_adapters(setup) -> None:
    models = setup["engine"].models()
    assert [(m.id, m.parent) for m in models] == [(setup["tiny"], None), ("a", setup["tiny"]), ("b", setup["tiny"])]
    assert setup["engine"].plan.dtype == "float32", "adapters are served in the dtype their runs trained in"


@pytest.mark.parametrize("name, temperature", [("a", "0"), ("b", "0"), ("a", "1.0")])
def test_evaluating_through_the_endpoint_equals_evaluating_the_run(setup, name, temperature, tmp_path) -> None:
    """Greedy, and seeded sampling too: the server samples the same batch with the same seed."""
    local, local_transcripts = _eval("--run", str(setup["runs"][name]), "--temperature", temperature, out=tmp_path / "local.jsonl")
    served, served_transcripts = _eval(
        "--endpoint", setup["url"] + "/v1", "--model", name, "--tokenizer", setup["tiny"], "--api-key-file", str(setup["key_file"]),
        "--temperature", temperature, out=tmp_path / "served.jsonl",
    )
    assert local.exit_code == 0 and served.exit_code == 0, served.output
    assert json.loads(served.stdout.splitlines()[-1]) == json.loads(local.stdout.splitlines()[-1])
    assert served_transcripts == local_transcripts
    assert len(served_transcripts) == 4


def test_two_adapters_served_at_once_give_their_own_answers(setup, tmp_path) -> None:
    answers = {}
    for name in ("a", "b", setup["tiny"]):
        result, transcripts = _eval(
            "--endpoint", setup["url"], "--model", name, "--tokenizer", setup["tiny"], "--api-key-file", str(setup["key_file"]),
            out=tmp_path / f"{len(answers)}.jsonl",
        )
        assert result.exit_code == 0, result.output
        answers[name] = [[m["content"] for m in t["messages"] if m["role"] == "assistant"] for t in transcripts]
    assert answers["a"] != answers["b"] and answers["a"] != answers[setup["tiny"]] and answers["b"] != answers[setup["tiny"]]


def test_the_openai_client_works_against_the_server(setup) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=setup["url"] + "/v1", api_key=KEY)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {setup["tiny"], "a", "b"}
    assert listed["a"].parent == setup["tiny"] and listed["b"].parent == setup["tiny"]

    messages = [{"role": "system", "content": "Pick an arm."}, {"role": "user", "content": "Arms: 0, 1, 2."}]
    chat = client.chat.completions.create(model="a", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 6
    stream = client.chat.completions.create(model="a", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == chat.choices[0].message.content

    prompt = setup["engine"].tokenizer("Arms: 0, 1, 2.")["input_ids"]
    completion = client.completions.create(
        model="b", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    choice = completion.choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens) and len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.text == setup["engine"].tokenizer.decode(ids[:-1] if choice.finish_reason == "stop" else ids, skip_special_tokens=True)
    text = client.completions.create(model="b", prompt="Arms: 0, 1, 2.", max_tokens=5, temperature=0)
    assert text.choices[0].text == choice.text, "a text prompt is tokenized as the token-id prompt was made"
    streamed = client.completions.create(model="b", prompt=prompt, max_tokens=5, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == choice.text


def test_sampled_ids_match_the_backend_and_adapters_switch_per_request(setup) -> None:
    engine = setup["engine"]
    prompt = [[5, 6, 7, 8]]
    from tinkergym.protocol.types import SamplingParams

    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=[-1])
    first = {name: engine.generate(name, prompt, params, 1)[0][0].tokens for name in ("a", "b", setup["tiny"])}
    again = {name: engine.generate(name, prompt, params, 1)[0][0].tokens for name in (setup["tiny"], "b", "a")}
    assert first == again


def test_concurrent_requests_to_different_adapters_get_their_own_answers(setup) -> None:
    from concurrent.futures import ThreadPoolExecutor

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def ask(name: str) -> list[str]:
        body = {"model": name, "prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 6, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
        request = urllib.request.Request(setup["url"] + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return [c["logprobs"]["tokens"] for c in json.loads(response.read())["choices"]]

    names = ["a", "b", setup["tiny"]] * 4
    alone = {name: ask(name) for name in set(names)}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, names))
    assert together == [alone[name] for name in names]
    assert alone["a"] != alone["b"]


def test_every_route_needs_the_key(setup) -> None:
    from fastapi.testclient import TestClient

    client = TestClient(setup["app"])
    routes = [(route.path, method) for route in setup["app"].routes for method in sorted(getattr(route, "methods", None) or {"GET"}) if method != "HEAD"]
    assert {("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/health", "GET")} <= set(routes)
    for path, method in routes:
        for headers in ({}, {"Authorization": "Bearer " + "x" * len(KEY)}, {"Authorization": KEY}):
            answer = client.request(method, path, headers=headers, json={})
            if path == "/health":
                assert answer.status_code == 200
            else:
                assert answer.status_code == 401, (method, path, headers)
                assert answer.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert ("/v1/tokenizer", "GET") in routes


def test_eval_through_an_endpoint_uses_the_servers_tokenizer_when_none_is_given(setup, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))
    given, given_transcripts = _eval("--endpoint", setup["url"], "--model", "a", "--tokenizer", setup["tiny"],
                                     "--api-key-file", str(setup["key_file"]), out=tmp_path / "given.jsonl")
    fetched, fetched_transcripts = _eval("--endpoint", setup["url"], "--model", "a", "--api-key-file", str(setup["key_file"]),
                                         out=tmp_path / "fetched.jsonl")
    assert fetched.exit_code == 0, fetched.output
    assert fetched_transcripts == given_transcripts and fetched.stdout.splitlines()[-1] == given.stdout.splitlines()[-1]
    cached = list((tmp_path / "cache" / "remote").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file() and (cached[0] / "tokenizer_config.json").is_file()


def test_a_server_without_the_tokenizer_route_asks_for_tokenizer(tmp_path) -> None:
    from tinkergym.backends.endpoint_sampler import EndpointSampler
    from tinkergym.errors import ConfigError

    server = ThreadingHTTPServer(("127.0.0.1", 0), type("NotFound", (BaseHTTPRequestHandler,), {
        "do_GET": lambda self: (self.send_response(404), self.send_header("Content-Length", "2"), self.end_headers(), self.wfile.write(b"{}")),
        "log_message": lambda self, *a: None}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="pass --tokenizer"):
            EndpointSampler(f"http://127.0.0.1:{server.server_address[1]}", "m").fetch_tokenizer(tmp_path)
    finally:
        server.shutdown()


def test_unknown_model_is_404_with_the_served_names(setup) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=setup["url"] + "/v1", api_key=KEY)
    for call in (
        lambda: client.completions.create(model="nope", prompt=[1, 2], max_tokens=2),
        lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert all(name in str(caught.value) for name in (setup["tiny"], "a", "b"))


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": [99_999_999]}, "prompt token ids must lie in"),
        ({"prompt": []}, "between 1 and"),
        ({"prompt": [1], "max_tokens": 10**9}, "maximum context length"),
        ({"prompt": [1], "stop": ["\n"]}, "stop strings are not supported"),
        ({"prompt": [1], "logprobs": 5}, "logprobs above 1"),
        ({"prompt": [1], "n": 10**6}, "n:"),
        ({"prompt": [1], "temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_are_400_in_openai_shape(setup, body, message) -> None:
    from fastapi.testclient import TestClient

    answer = TestClient(setup["app"]).post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={"model": "a", **body})
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


def test_bodies_over_the_limit_are_413_declared_or_streamed(setup) -> None:
    """A body over the limit is refused whether it declares its length or streams in chunks without one."""
    from fastapi.testclient import TestClient

    client = TestClient(create_inference_app(setup["engine"], token_digest(KEY), max_body_bytes=4096))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = json.dumps({"model": "a", "prompt": list(range(1, 3000)), "max_tokens": 1}).encode()
    declared = client.post("/v1/completions", headers=headers, content=big)
    streamed = client.post("/v1/completions", headers=headers, content=iter([big[i : i + 1000] for i in range(0, len(big), 1000)]))
    for answer in (streamed, declared):
        assert answer.status_code == 413, answer.text
        assert "at most 4,096 bytes" in answer.json()["error"]["message"] and answer.json()["error"]["code"] == 413
    small = client.post("/v1/completions", headers=headers, content=json.dumps({"model": "a", "prompt": [5, 6], "max_tokens": 1}).encode())
    assert small.status_code == 200, small.text


class _TextOnly(BaseHTTPRequestHandler):
    """An OpenAI-shaped server whose completions carry text and no token ids."""

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"object": "text_completion", "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]})

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_returns_only_text_is_refused(setup, tmp_path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TextOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        result = CliRunner().invoke(main, ["eval", *EVAL, "--endpoint", url, "--model", "m", "--tokenizer", setup["tiny"]])
    finally:
        server.shutdown()
    assert result.exit_code == 2, result.output
    assert "answers completions with text, not token ids" in result.output


@pytest.mark.parametrize(
    "model, right_key, message",
    [("a", False, "refused the API key (HTTP 401)"), ("nope", True, "does not serve 'nope'; it serves:")],
)
def test_eval_endpoint_errors_say_what_to_do(setup, model, right_key, message, tmp_path) -> None:
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("x" * 40)
    key = setup["key_file"] if right_key else wrong
    args = ["eval", *EVAL, "--endpoint", setup["url"], "--tokenizer", setup["tiny"], "--model", model, "--api-key-file", str(key)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", *EVAL, "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--run", "{run_a}"], "and no --run"),
        (["eval", *EVAL, "--model", "m", "--api-key", "tgk_x"], "go with --scheduler"),
        (["serve", "model", "--model", "{tiny}", "--gpus", "2", "--api-key-file", "{key}"], "go with --scheduler"),
        (["serve", "model", "--model", "{tiny}"], "--api-key-file is required"),
        (["serve", "model", "--model", "{tiny}", "--scheduler", "http://127.0.0.1:9", "--port", "9000"], "--port: the worker sets"),
        (["serve", "model", "--model", "{tiny}", "--checkpoint", "c={run_a}", "--api-key-file", "{key}"], "not a checkpoint folder"),
        (["serve", "model", "--run", "{run_a}", "--checkpoint", "c={run_a}", "--api-key-file", "{key}"], "give --model, not --run"),
        (["eval", *EVAL, "--model", "m", "--tokenizer", "tiny"], "go with --endpoint"),
        (["eval", *EVAL, "--endpoint", "ftp://x", "--model", "m", "--tokenizer", "{tiny}"], "http:// or https://"),
        (["serve", "model", "--model", "{tiny}", "--api-key-file", "{short_key}"], "at least 32 characters"),
        (["serve", "model", "--model", "{tiny}", "--adapter", "noequals", "--api-key-file", "{key}"], "expected NAME=PATH"),
        (["serve", "model", "--model", "{tiny}", "--adapter", "a={tiny}", "--api-key-file", "{key}"], "not a run, a checkpoint"),
        (["serve", "model", "--model", "{tiny}", "--adapter", "x={run_a}", "--adapter", "x={run_b}", "--api-key-file", "{key}"], "already served"),
        (["serve", "model", "--run", "{run_a}", "--model", "{tiny}", "--api-key-file", "{key}"], "exactly one"),
    ],
)
def test_bad_serving_input_exits_2_before_loading(setup, args, message, tmp_path) -> None:
    short_key = tmp_path / "short.txt"
    short_key.write_text("short")
    short_key.chmod(0o600)
    values = {"tiny": setup["tiny"], "key": setup["key_file"], "short_key": short_key, "run_a": setup["runs"]["a"], "run_b": setup["runs"]["b"]}
    result = CliRunner().invoke(main, [a.format(**values) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_full_finetuning_run_is_served_as_its_own_model(setup, tmp_path) -> None:
    run = _train(setup["tiny"], tmp_path / "full_run", "--steps", "1", "--full")
    plan = plan_serving(run=str(run))
    assert not plan.lora and plan.base_id == "full_run" and plan.base_path == str(run / "final")
    server = ThreadServer(create_inference_app(TorchInferenceEngine(plan), token_digest(KEY)))
    try:
        local, local_transcripts = _eval("--run", str(run), out=tmp_path / "local.jsonl")
        served, served_transcripts = _eval(
            "--endpoint", server.url, "--model", "full_run", "--tokenizer", str(run / "final"), "--api-key-file", str(setup["key_file"]),
            out=tmp_path / "served.jsonl",
        )
    finally:
        server.stop()
    assert served.exit_code == 0, served.output
    assert served_transcripts == local_transcripts and served.stdout.splitlines()[-1] == local.stdout.splitlines()[-1]
    # Its last checkpoint (what a scheduler's worker serves) given with --checkpoint: the same model under the name given.
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    plan = plan_serving(model=setup["tiny"], checkpoint=("tuned", str(checkpoint)))
    assert not plan.lora and plan.base_id == "tuned" and plan.state == str(checkpoint) and plan.dtype == "float32"
    server = ThreadServer(create_inference_app(TorchInferenceEngine(plan), token_digest(KEY)))
    try:
        from_checkpoint, checkpoint_transcripts = _eval("--endpoint", server.url, "--model", "tuned", "--api-key-file",
                                                        str(setup["key_file"]), out=tmp_path / "checkpoint.jsonl")
    finally:
        server.stop()
    assert from_checkpoint.exit_code == 0, from_checkpoint.output
    assert checkpoint_transcripts == local_transcripts and from_checkpoint.stdout.splitlines()[-1] == local.stdout.splitlines()[-1]


def test_a_lora_checkpoint_given_with_checkpoint_is_an_adapter(setup) -> None:
    checkpoint_b = sorted((setup["runs"]["b"] / "checkpoints").iterdir())[-1]
    plan = plan_serving(model=setup["tiny"], checkpoint=("tuned", str(checkpoint_b)))
    assert plan.lora and plan.base_id == setup["tiny"] and [(a.name, a.path, a.kind) for a in plan.adapters] == [("tuned", str(checkpoint_b), "checkpoint")]


@pytest.mark.slow
def test_the_serve_model_command_serves_a_run(setup) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "tinkergym", "serve", "model", "--run", str(setup["runs"]["a"]), "--api-key-file", str(setup["key_file"]),
               "--port", str(port), "--idle-timeout", "3", "--metrics-port", str(metrics_port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=60, process=process, output=exited_output(process))
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            listed = json.loads(response.read())
        assert [(m["id"], m["parent"]) for m in listed["data"]] == [(setup["tiny"], None), ("run_a", setup["tiny"])]
        # Requests keep it up past its idle timeout; /health and refused keys do not count; then it stops on its own.
        for _ in range(4):
            time.sleep(1)
            with urllib.request.urlopen(request, timeout=5):
                pass
        assert process.poll() is None
        # its metrics on their own loopback listener (a scrape is no request of a client: it keeps nothing alive)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                       for f in text_string_to_metric_families(response.read().decode()) for x in f.samples}
        labels = (("code", "200"), ("method", "GET"), ("route", "/v1/models"), ("server", "inference"))
        assert samples[("tinkergym_http_requests_total", labels)] == 5
        last = time.monotonic()
        bad = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer " + "x" * 40})
        while process.poll() is None and time.monotonic() - last < 30:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    pass
                urllib.request.urlopen(bad, timeout=5)
                raise AssertionError("a wrong key was let in")
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
            except OSError:  # stopping: the port is closed
                break
            time.sleep(0.3)
        assert process.wait(timeout=30) == 75, process.stdout.read()
        assert time.monotonic() - last >= 2.5
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_engine_vllm_without_vllm_exits_2_saying_to_install_it(setup) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here (the vLLM lane tests --engine vllm)")
    args = ["serve", "model", "--engine", "vllm", "--model", setup["tiny"], "--api-key-file", str(setup["key_file"])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "--engine vllm needs the vllm package" in result.output and "install" in result.output
    assert "--engine [auto|torch|vllm]" in CliRunner().invoke(main, ["serve", "model", "--help"]).output
