"""`tinkergym serve-tinker` as its own process: a key made by `tinkergym scheduler keys create` on its database, the SDK
training and sampling through it, and a refused key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("torch")

from testkit import exited_output, free_port, wait_until_answers  # noqa: E402  # registered by tests/conftest.py


@pytest.mark.slow
def test_serve_tinker_process_with_a_scheduler_key(tiny: str, tmp_path: Path) -> None:
    from tinker import types

    env = {**os.environ, "TINKERGYM_CACHE": str(tmp_path / "cache")}
    made = subprocess.run([sys.executable, "-m", "tinkergym", "scheduler", "keys", "create", "--tenant", "alice", "--scopes", "read,write",
                           "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, env=env, timeout=120)
    assert made.returncode == 0, made.stderr
    key = "tml-" + made.stdout.strip()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve-tinker", "--model", tiny, "--model-name", "tiny-cli", "--dtype", "float32",
                               "--port", str(port), "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "runs")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_until_answers(f"{url}/api/v1/healthz", timeout=120, process=server, output=exited_output(server))
        with tinker.ServiceClient(base_url=url, api_key=key) as service:
            training = service.create_lora_training_client(base_model="tiny-cli", rank=4).result()
            tokens = list(range(10, 30))
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
            losses = []
            for _ in range(3):
                fwd = training.forward_backward([datum], "cross_entropy")
                training.optim_step(types.AdamParams(learning_rate=3e-2))
                losses.append(fwd.result().metrics["loss:sum"])
            assert losses[-1] < losses[0]
            path = training.save_weights_for_sampler("cli").result().path
            sampled = service.create_sampling_client(model_path=path).sample(types.ModelInput.from_ints(tokens[:3]), 2,
                                                                              types.SamplingParams(max_tokens=4)).result()
            assert [len(s.tokens) for s in sampled.sequences] == [4, 4]
        assert (tmp_path / "runs" / "server.log").is_file()
        with pytest.raises(Exception, match="401|not valid"):
            tinker.ServiceClient(base_url=url, api_key="tml-tgk_000000000000_" + "x" * 43).create_lora_training_client(base_model="tiny-cli", rank=4)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    ([], "one of them"),
    (["--model", "tiny", "--scheduler", "http://127.0.0.1:9"], "not both"),
    (["--scheduler", "http://127.0.0.1:9"], "--offer MODEL"),
    (["--model", "tiny", "--offer", "tiny"], "--offer names the models of a cluster"),
])
def test_serve_tinker_refuses_a_muddled_command_line(args: list[str], message: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tinkergym.cli import main

    done = CliRunner().invoke(main, ["serve-tinker", "--run-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "data"), *args])
    assert done.exit_code == 2 and message in done.output, done.output
