"""Training through RemoteBackend against a real training server (uvicorn on 127.0.0.1 around a TorchBackend on the tiny model).

A remote run equals the same local run metric for metric, resumes exactly, survives a lost answer and a 503
without applying a step twice, downloads a ``final/`` that peft loads, and its client side never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from testkit import wait_until  # registered by tests/conftest.py

from tinkergym.backends.remote import REMOTE_STATE, RemoteBackend, server_name
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams
from tinkergym.cli import main
from tinkergym.errors import ConfigError, OutOfMemoryError
from tinkergym.trainers.reporting import read_metrics

VOLATILE = ("time/", "tokens/per_s")
TOKEN = "remote-backend-test-token-0123456789abcdef"


class FlakyApp:
    """ASGI wrapper that lets chosen calls run on the server, then loses their answer: a 503, or a connection cut mid-body."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.plan: dict[str, str] = {}  # method -> "503" or "cut", each used once
        self.lost: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/call" or not self.plan:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        method = json.loads(body).get("method")
        fault = self.plan.pop(method, None)
        replayed = [False]

        async def replay():
            if replayed[0]:
                return {"type": "http.disconnect"}
            replayed[0] = True
            return {"type": "http.request", "body": body, "more_body": False}

        if fault is None:
            return await self.app(scope, replay, send)
        held: list[dict] = []

        async def hold(message):
            held.append(message)

        await self.app(scope, replay, hold)  # the call runs on the server; the client never hears of it
        self.lost.append(f"{method}:{fault}")
        if fault == "503":
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": {"type": "unavailable", "message": "try again"}}'})
            return None
        await send(held[0])
        await send({"type": "http.response.body", "body": held[1]["body"][:5], "more_body": True})
        raise ConnectionResetError("answer cut")


class Server:
    """A training server in a thread of this process, around a fresh TorchBackend (seed 0, float32, LoRA rank 8)."""

    def __init__(self, tiny: str, run_dir: Path) -> None:
        import uvicorn

        from tinkergym.serve.training.app import create_app
        from tinkergym.serve.auth import token_digest
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        self.backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", lora_rank=8, lora_alpha=16, seed=0))
        self.run_dir = run_dir
        self.app = FlakyApp(create_app(self.backend, run_dir=run_dir, token_digest=token_digest(TOKEN)))
        # proto IPPROTO_TCP, as uvicorn's own sockets: asyncio turns Nagle off only for those (else 40 ms per keep-alive request)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until("the server to start", lambda: self.server.started, timeout=30, every=0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server(tiny, tmp_path):
    started = Server(tiny, tmp_path / "server")
    yield started
    started.stop()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))


def _common(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--env", "tinker/Bandit-v0", "--steps", "4", "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "6",
        "--lr", "1e-3", "--checkpoint-every", "1", "--quiet", "--out", str(out), *extra,
    ]


def _remote(server: Server, token_file: Path, out: Path, *extra: str) -> list[str]:
    return _common(out, "--backend-url", server.url, "--backend-token-file", str(token_file), *extra)


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _invoke(args: list[str]) -> None:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_remote_run_equals_the_local_run_and_exports_a_loadable_adapter(tiny, server, token_file, tmp_path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    evaluation = ("--eval-every", "2", "--eval-episodes", "2")
    _invoke(_common(local, "--model", tiny, "--dtype", "float32", *evaluation))
    _invoke(_remote(server, token_file, remote, *evaluation))
    assert _stable(read_metrics(remote / "metrics.jsonl")) == _stable(read_metrics(local / "metrics.jsonl"))
    config = json.loads((remote / "config.json").read_text())
    assert config["backend_url"] == server.url and config["model"] == Path(tiny).name and config["lora_rank"] == 8
    assert TOKEN not in "".join(p.read_text(errors="replace") for p in remote.rglob("*") if p.is_file())
    note = json.loads((remote / "checkpoints" / "step_000003" / REMOTE_STATE).read_text())
    assert note == {"url": server.url, "name": "step_000003", "step": server.backend.step, "protocol": 1}
    assert (server.run_dir / "states" / "step_000003").is_dir()

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in (remote / "final").iterdir()) == sorted(p.name for p in (local / "final").iterdir())
    weights = load_file(remote / "final" / "adapter_model.safetensors")
    expected = load_file(local / "final" / "adapter_model.safetensors")
    assert weights.keys() == expected.keys() and all(weights[k].equal(expected[k]) for k in weights)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(remote / "final"))


@pytest.mark.slow
def test_resume_of_a_remote_run_continues_exactly(tiny, server, token_file, tmp_path) -> None:
    short, whole = tmp_path / "short", tmp_path / "whole"
    _invoke(_remote(server, token_file, short, "--steps", "2"))
    resumed = CliRunner().invoke(main, ["train", "--resume", str(short), "--steps", "4", "--quiet"])
    assert resumed.exit_code == 2 and "--backend-token-file" in resumed.output  # the token is never in the run folder
    _invoke(["train", "--resume", str(short), "--steps", "4", "--quiet", "--backend-token-file", str(token_file)])
    other = Server(tiny, tmp_path / "server2")  # a fresh server: the uninterrupted run starts from the same weights and RNG
    try:
        _invoke(_remote(other, token_file, whole))
    finally:
        other.stop()
    assert _stable(read_metrics(short / "metrics.jsonl")) == _stable(read_metrics(whole / "metrics.jsonl"))


@pytest.mark.parametrize("fault", ["503", "cut"])
def test_a_lost_answer_is_retried_and_the_step_applied_once(server, fault) -> None:
    backend = RemoteBackend(server.url, TOKEN, backoff=0.01)
    backend.info()
    datum = Datum(tokens=[1, 5, 6, 7, 2], loss_mask=[0, 1, 1, 1, 1])
    backend.forward_backward(ForwardBackwardRequest(data=[datum], loss=LossSpec(name="cross_entropy")))
    server.app.plan = {"optim_step": fault}
    metrics = backend.optim_step(OptimParams(learning_rate=1e-3))
    assert server.app.lost == [f"optim_step:{fault}"]
    assert server.backend.step == 1 and metrics["step"] == 1.0
    assert backend.optim_step(OptimParams(learning_rate=1e-3))["step"] == 2.0  # the next call is numbered after the retried one
    backend.close()


def test_errors_say_what_to_do(server, tmp_path) -> None:
    with pytest.raises(ConfigError, match="--backend-token-file"):
        RemoteBackend(server.url, "wrong-token-" + "x" * 32).info()
    backend = RemoteBackend(server.url, TOKEN)
    with pytest.raises(ConfigError, match="refused"):
        backend.forward_backward(ForwardBackwardRequest(data=[Datum(tokens=[1, 2], loss_mask=[0, 1])], loss=LossSpec(name="no-such-loss")))
    assert backend.logprobs([[1, 2, 3]])[0][0] == 0.0  # a refused call leaves the client usable
    import torch

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    layer = next(m for m in server.backend.model.modules() if type(m).__name__.endswith("DecoderLayer"))
    handle = layer.register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(OutOfMemoryError, match="the training server: training pass ran out of .* memory.*--micro-batch-size"):
            backend.forward_backward(ForwardBackwardRequest(data=[Datum(tokens=[1, 2, 3], loss_mask=[0, 1, 1])], loss=LossSpec(name="cross_entropy")))
    finally:
        handle.remove()
    assert backend.logprobs([[1, 2, 3]])[0][0] == 0.0
    local = tmp_path / "local_checkpoint"
    local.mkdir()
    (local / "state.json").write_text("{}")
    with pytest.raises(ConfigError, match="local checkpoint"):
        backend.load_state(str(local))
    assert server_name("runs/x/checkpoints/step_000004.staging.tmp") == "step_000004" and server_name("/a/final/") == "final"
    with pytest.raises(ConfigError):
        server_name("/a/b c")
    unreachable = RemoteBackend("http://127.0.0.1:9", TOKEN, retries=1, backoff=0.01)
    with pytest.raises(Exception, match="no answer from the training server"):
        unreachable.info()


def test_cli_refuses_model_options_and_stray_tokens(server, token_file, tmp_path) -> None:
    result = CliRunner().invoke(main, _remote(server, token_file, tmp_path / "a", "--lora-rank", "4"))
    assert result.exit_code == 2 and "--lora-rank" in result.output and "serve backend" in result.output
    result = CliRunner().invoke(main, _common(tmp_path / "b", "--backend-token-file", str(token_file)))
    assert result.exit_code == 2 and "--backend-url" in result.output
    result = CliRunner().invoke(main, _common(tmp_path / "c", "--backend-url", "ftp://host"))
    assert result.exit_code == 2 and "not a training server URL" in result.output


CLIENT = """
import json, sys
sys.modules["torch"] = None  # as in an install without torch: importing it fails, transformers sees none
from tinkergym.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    loaded = sorted(m for m in sys.modules if m == "torch" and sys.modules[m] is not None or m.startswith("torch."))
    print(json.dumps({"torch_modules": loaded}))
"""


@pytest.mark.slow
def test_the_client_side_trains_without_torch(server, token_file, tmp_path) -> None:
    out = tmp_path / "torchless"
    env = {**os.environ, "TINKERGYM_CACHE": str(tmp_path / "client-cache")}
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, *_remote(server, token_file, out, "--steps", "2")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch_modules": []}
    assert len(read_metrics(out / "metrics.jsonl")) == 2 and (out / "final" / "adapter_model.safetensors").is_file()
    assert any((out / "tensorboard").iterdir())


def _source_copy(dest: Path) -> Path:
    """The repository without virtual environments, build outputs and caches, so pip builds it from a clean tree."""
    repo = Path(__file__).resolve().parents[2]
    skip = {".git", "__pycache__", "build", "dist", "runs", ".cache", ".pytest_cache"}
    shutil.copytree(repo, dest, ignore=lambda _, names: {n for n in names if n in skip or n.startswith(".venv") or n.endswith(".egg-info")})
    return dest


@pytest.mark.slow
def test_a_client_only_install_trains_through_the_server(server, token_file, tmp_path) -> None:
    """``pip install '.[client]'`` plus an env package, no torch: that environment trains through the server.

    Installed with uv where the test environment has it (``make install`` puts it there, its cache holding every wheel
    the client needs): the same build of the same metadata that pip would install, without pip's downloads."""
    source, venv, out = _source_copy(tmp_path / "src"), tmp_path / "client-venv", tmp_path / "run"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    packages = [f"{source}[client]", str(source / "env_packages" / "bandit")]
    uv = Path(sys.executable).with_name("uv")
    if uv.is_file():
        where = subprocess.run([sys.executable, str(source / "tools" / "uv_args.py"), str(python)], capture_output=True, text=True, check=True)
        command = [str(uv), "pip", "install", "--quiet", "--python", str(python), *where.stdout.split(), *packages]
    else:
        command = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *packages]
    install = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    assert subprocess.run([str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"]).returncode == 0
    env = {**os.environ, "TINKERGYM_CACHE": str(tmp_path / "client-cache")}
    done = subprocess.run(
        [str(venv / "bin" / "tinkergym"), *_remote(server, token_file, out, "--steps", "2")], capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(read_metrics(out / "metrics.jsonl")) == 2 and (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / "learning_curve.png").is_file() and any((out / "tensorboard").iterdir())


@pytest.mark.slow
def test_a_connection_the_server_closed_while_idle_is_replaced_at_once(tiny, tmp_path, monkeypatch) -> None:
    from tinkergym.backends import remote as remote_module
    from tinkergym.serve.asgi import ThreadServer
    from tinkergym.serve.training.app import create_app
    from tinkergym.serve.auth import token_digest
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", lora_rank=8, seed=0))
    server = ThreadServer(create_app(backend, run_dir=tmp_path / "server", token_digest=token_digest(TOKEN)), timeout_keep_alive=1)
    slept: list[float] = []
    # The client module's own sleeps are recorded, not the process's: time.sleep itself patched would make every other
    # thread here that sleeps in a loop (a server's maintenance pass an earlier test left) spin, filling the record.
    recorder = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    recorder.sleep = slept.append
    monkeypatch.setattr(remote_module, "time", recorder)
    try:
        client = RemoteBackend(server.url, TOKEN, backoff=5.0)
        client.logprobs([[1, 5, 6]])
        deadline = time.monotonic() + 3  # the server closes the kept-alive connection after 1 s of silence
        while time.monotonic() < deadline:  # (time.sleep is the recorder here)
            pass
        assert len(client.logprobs([[1, 5, 6, 7]])[0]) == 4
        assert slept == [] and client.wire.requests >= 4  # sent again on a new connection, with no backoff
    finally:
        server.stop()


def test_a_ping_from_another_thread_during_an_export_waits_for_the_download(server, tmp_path, monkeypatch) -> None:
    """A keep-alive thread pings while the export's files download on the same connection: the ping sends nothing (the
    download is a sign of life), and the folder arrives whole."""
    import tinkergym.backends.remote as remote_module

    backend = RemoteBackend(server.url, TOKEN)
    backend.info()
    pings: list[Any] = []
    real_save = remote_module.save_checked

    def save_while_pinged(response: Any, dest: Path, size: int, sha256: str) -> None:
        def ping() -> None:
            try:
                pings.append(backend.ping())
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                pings.append(exc)

        pinger = threading.Thread(target=ping)
        pinger.start()
        pinger.join(timeout=10)
        real_save(response, dest, size, sha256)

    monkeypatch.setattr(remote_module, "save_checked", save_while_pinged)
    backend.export(str(tmp_path / "adapter"))
    assert pings and all(p is False for p in pings), pings
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    monkeypatch.setattr(remote_module, "save_checked", real_save)
    assert backend.ping() is True  # the connection goes on
    backend.close()
