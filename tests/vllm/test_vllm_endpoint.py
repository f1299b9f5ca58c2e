"""``tinkergym eval --endpoint`` against vLLM's own OpenAI server: the same transcripts as through ``serve model``.

vLLM serves the tiny base and a trained LoRA adapter (``--lora-modules a=<run>/final``); ``serve model`` serves the
same two names. Both run in float32, where their logprobs agree to about 1e-5, so greedy evaluation through
either endpoint plays the same episodes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from testkit import exited_output, wait_until_answers  # registered by tests/conftest.py

from tinkergym.cli import main

KEY = "vllm-endpoint-test-key-" + "k" * 20
EVAL = ("--env", "tinker/Bandit-v0", "--episodes", "4", "--max-new-tokens", "6", "--max-turns", "1")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def endpoints(tiny: str, tmp_path_factory: pytest.TempPathFactory):
    import uvicorn

    from tinkergym.backends.serving import plan_serving
    from tinkergym.backends.torch.inference import TorchInferenceEngine
    from tinkergym.serve.inference.app import create_inference_app
    from tinkergym.serve.auth import token_digest

    root = tmp_path_factory.mktemp("endpoints")
    run = root / "run_a"
    train = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--steps", "2", "--batch-size", "2",
             "--group-size", "4", "--max-new-tokens", "6", "--lr", "3e-2", "--lora-rank", "8", "--quiet", "--out", str(run)]
    assert CliRunner().invoke(main, train, catch_exceptions=False).exit_code == 0
    key_file = root / "key.txt"
    key_file.write_text(KEY)
    key_file.chmod(0o600)

    port = _free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--max-model-len", "1024", "--api-key", KEY, "--gpu-memory-utilization", "0.3",
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={run / 'final'}",
    ]
    vllm_server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    ours = uvicorn.Server(uvicorn.Config(create_inference_app(TorchInferenceEngine(plan_serving(model=tiny, adapters=[("a", str(run))])), token_digest(KEY)), log_level="warning"))
    # proto IPPROTO_TCP, as uvicorn's own sockets: asyncio turns Nagle off only for those (else 40 ms per keep-alive request)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=ours.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        vllm_url = f"http://127.0.0.1:{port}"
        wait_until_answers(vllm_url + "/health", timeout=300, every=0.5, process=vllm_server, output=exited_output(vllm_server))
        ours_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wait_until_answers(ours_url + "/health", timeout=60, every=0.5)
        yield {"tiny": tiny, "key_file": key_file, "vllm": vllm_url, "ours": ours_url}
    finally:
        ours.should_exit = True
        thread.join(timeout=10)
        sock.close()
        vllm_server.terminate()
        try:
            vllm_server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            vllm_server.kill()


@pytest.mark.parametrize("model", ["a", "base"])
def test_eval_through_vllm_equals_eval_through_serve_model(endpoints, model: str, tmp_path: Path) -> None:
    name = endpoints["tiny"] if model == "base" else model
    outputs = {}
    for server in ("vllm", "ours"):
        out = tmp_path / f"{server}.jsonl"
        args = ["eval", *EVAL, "--endpoint", endpoints[server] + "/v1", "--model", name, "--tokenizer", endpoints["tiny"],
                "--api-key-file", str(endpoints["key_file"]), "--out", str(out), "--json"]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        outputs[server] = (json.loads(result.stdout.splitlines()[-1]), [json.loads(line) for line in out.read_text().splitlines()])
    assert outputs["vllm"] == outputs["ours"]
    assert len(outputs["vllm"][1]) == 4


def test_vllm_lists_adapters_as_serve_model_does(endpoints) -> None:
    listings = {}
    for server in ("vllm", "ours"):
        request = urllib.request.Request(endpoints[server] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            listings[server] = [(m["id"], m["parent"]) for m in json.loads(response.read())["data"]]
    assert listings["vllm"] == listings["ours"] == [(endpoints["tiny"], None), ("a", endpoints["tiny"])]
