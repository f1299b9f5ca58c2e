"""``serve model`` with the vLLM engine: the tiny base and two trained adapters served by one ``vllm.LLM``.

Adapter ``a`` is a run folder (its exported peft ``final/``), adapter ``b`` a checkpoint folder (converted to a
peft folder when the engine starts). Everything runs in float32, where vLLM's and torch's logprobs agree to
about 1e-5, so greedy evaluation through the server plays the episodes ``tinkergym eval --run`` plays.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from testkit import exited_output, wait_until_answers  # registered by tests/conftest.py

from tinkergym.serve.asgi import ThreadServer
from tinkergym.cli import main

KEY = "vllm-serve-model-test-key-" + "k" * 20
EVAL = ("--env", "tinker/Bandit-v0", "--episodes", "4", "--max-new-tokens", "6", "--max-turns", "1", "--temperature", "0")


def _train(tiny: str, out: Path, *extra: str) -> Path:
    args = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--dtype", "float32", "--batch-size", "2", "--group-size", "4",
            "--max-new-tokens", "6", "--lr", "3e-2", "--checkpoint-every", "1", "--quiet", "--out", str(out), *extra]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _get(url: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def served(tiny: str, tmp_path_factory: pytest.TempPathFactory):
    from tinkergym.backends.serving import plan_serving
    from tinkergym.serve.inference.app import create_inference_app
    from tinkergym.serve.auth import token_digest
    from tinkergym.backends.vllm.inference import VLLMInferenceEngine

    root = tmp_path_factory.mktemp("vllm-serving")
    key_file = root / "key.txt"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    run_a = _train(tiny, root / "run_a", "--steps", "2", "--seed", "7", "--lora-rank", "8")
    run_b = _train(tiny, root / "run_b", "--steps", "3", "--seed", "8", "--lora-rank", "16")
    for run in (run_a, run_b):  # the seeds are ones whose groups' rewards differ, so the adapters move
        trained = [json.loads(line)["batch/trained_sequences"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert sum(trained) > 0, f"{run.name}'s groups all had one reward ({trained} sequences trained), so its adapter never moved; take another seed"
    checkpoint_b = sorted((run_b / "checkpoints").iterdir())[-1]
    plan = plan_serving(model=tiny, adapters=[("a", str(run_a)), ("b", str(checkpoint_b))])
    engine = VLLMInferenceEngine(plan, max_model_len=1024)
    app = create_inference_app(engine, token_digest(KEY))
    server = ThreadServer(app)
    try:
        yield {"tiny": tiny, "key_file": key_file, "runs": {"a": run_a, "b": run_b}, "checkpoint_b": checkpoint_b,
               "engine": engine, "url": server.url}
    finally:
        server.stop()
        engine.close()


def _eval(*args: str, out: Path):
    result = CliRunner().invoke(main, ["eval", *EVAL, *args, "--out", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1]), [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("name", ["a", "b"])
def test_eval_through_the_vllm_engine_equals_eval_of_the_run(served, name: str, tmp_path: Path) -> None:
    local = _eval("--run", str(served["runs"][name]), out=tmp_path / "local.jsonl")
    through = _eval("--endpoint", served["url"] + "/v1", "--model", name, "--tokenizer", served["tiny"],
                    "--api-key-file", str(served["key_file"]), out=tmp_path / "served.jsonl")
    assert through == local
    assert len(through[1]) == 4


def test_the_two_adapters_and_the_base_answer_differently(served) -> None:
    body = {"prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 6, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
    answers = {}
    for name in ("a", "b", served["tiny"]):
        status, answer = _post(served["url"] + "/v1/completions", {"model": name, **body})
        assert status == 200, answer
        answers[name] = [c["logprobs"]["tokens"] for c in answer["choices"]]
    assert answers["a"] != answers["b"] and answers["a"] != answers[served["tiny"]] and answers["b"] != answers[served["tiny"]]


def test_token_ids_and_logprobs_match_the_torch_engine(served) -> None:
    """The sampled ids and their logprobs of /v1/completions are the torch engine's (float32, within 1e-4)."""
    from tinkergym.backends.serving import plan_serving
    from tinkergym.backends.torch.inference import TorchInferenceEngine
    from tinkergym.protocol.types import SamplingParams

    torch_engine = TorchInferenceEngine(plan_serving(model=served["tiny"], adapters=[("a", str(served["runs"]["a"])), ("b", str(served["checkpoint_b"]))]))
    prompt = served["engine"].tokenizer("Arms: 0, 1, 2.")["input_ids"]
    for name in ("a", "b", served["tiny"]):
        status, answer = _post(served["url"] + "/v1/completions", {
            "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 1,
            "return_tokens_as_token_ids": True, "ignore_eos": True,
        })
        assert status == 200, answer
        expected = torch_engine.generate(name, [prompt], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[-1]), 1)[0][0]
        assert len(answer["choices"]) == 2, "greedy with n > 1 is answered (vLLM is sent one request per copy)"
        for choice in answer["choices"]:
            ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            assert ids == expected.tokens and choice["finish_reason"] == "length"
            assert max(abs(x - y) for x, y in zip(choice["logprobs"]["token_logprobs"], expected.logprobs)) < 1e-4


def test_models_lists_the_base_and_its_adapters(served) -> None:
    status, listed = _get(served["url"] + "/v1/models")
    assert status == 200
    assert [(m["id"], m["parent"]) for m in listed["data"]] == [(served["tiny"], None), ("a", served["tiny"]), ("b", served["tiny"])]
    assert all(m["max_model_len"] == 1024 for m in listed["data"])


def test_an_unknown_model_is_404_with_the_served_names(served) -> None:
    status, answer = _post(served["url"] + "/v1/completions", {"model": "nope", "prompt": [1, 2], "max_tokens": 2})
    assert status == 404
    assert all(name in answer["error"]["message"] for name in (served["tiny"], "a", "b"))


def test_the_checkpoint_adapter_is_converted_to_a_peft_folder(served, tmp_path: Path) -> None:
    """The converted folder loads with peft and holds the checkpoint's weights."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tinkergym.backends.vllm.inference import checkpoint_to_peft

    folder = checkpoint_to_peft(str(served["checkpoint_b"]), served["tiny"], str(tmp_path / "peft"))
    config = json.loads(Path(folder, "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA" and config["target_modules"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served["tiny"], dtype=torch.float32), folder)
    params = dict(model.named_parameters())
    for name, value in load_file(str(served["checkpoint_b"] / "trainable.safetensors")).items():
        assert torch.equal(params[name], value), name


def test_a_full_finetuning_checkpoint_is_served_as_its_own_model(served, tmp_path: Path) -> None:
    """A full run's checkpoint (no final/ yet) is exported once and served; greedy ids equal the torch engine's."""
    from tinkergym.backends.serving import ServingPlan
    from tinkergym.backends.torch.inference import TorchInferenceEngine
    from tinkergym.protocol.types import SamplingParams
    from tinkergym.backends.vllm.inference import VLLMInferenceEngine

    run = _train(served["tiny"], tmp_path / "full_run", "--steps", "1", "--full")
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    plan = ServingPlan(base_id="full_run", base_path=served["tiny"], lora=False, state=str(checkpoint), dtype="float32")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[-1])
    prompts = [[5, 6, 7, 8], [9, 10]]
    expected = [row[0].tokens for row in TorchInferenceEngine(plan).generate("full_run", prompts, params, 1)]
    with VLLMInferenceEngine(plan, max_model_len=512) as engine:
        work_dir = engine._work_dir
        assert [m.id for m in engine.models()] == ["full_run"]
        assert [row[0].tokens for row in engine.generate("full_run", prompts, params, 1)] == expected
    assert not os.path.exists(work_dir), "close() removes the exported model"


def test_serve_model_engine_vllm_serves_a_run(served) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tinkergym", "serve", "model", "--engine", "vllm", "--run", str(served["runs"]["a"]),
               "--api-key-file", str(served["key_file"]), "--port", str(port), "--max-model-len", "512"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", timeout=180, every=0.5, process=process, output=exited_output(process))
        status, listed = _get(f"http://127.0.0.1:{port}/v1/models")
        assert [(m["id"], m["parent"]) for m in listed["data"]] == [(served["tiny"], None), ("run_a", served["tiny"])]
    finally:
        process.terminate()
        output = process.communicate(timeout=60)[0]
    assert "with the vllm engine" in output, output[-3000:]


def test_images_to_the_text_model_are_refused_not_ignored(served) -> None:
    """A chat image_url part sent to the vLLM engine of a text model is a 400 that says so."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 0, 0)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    status, answer = _post(served["url"] + "/v1/chat/completions", {
        "model": served["tiny"], "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Which?"}]}],
    })
    assert status == 400 and "is a text model" in answer["error"]["message"], answer
