"""`tinkergym serve tinker` as its own process: a key made by `tinkergym scheduler keys create` on its database, the SDK
training and sampling through it, and a refused key."""

from __future__ import annotations

import json
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
    server = subprocess.Popen([sys.executable, "-m", "tinkergym", "serve", "tinker", "--model", tiny, "--model-name", "tiny-cli", "--dtype", "float32",
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

    done = CliRunner().invoke(main, ["serve", "tinker", "--run-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "data"), *args])
    assert done.exit_code == 2 and message in done.output, done.output


def test_an_offer_without_a_tokenizer_names_one_clients_load_offline(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--offer tiny`` (no ``=TOKENIZER``) names tiny's folder in tinkergym's model cache, which the SDK's tokenizer loader
    reads with the hub offline; a folder names itself, a hub id stays, and a name tinkergym does not know stays with a
    one-line warning at start."""
    import importlib
    import shutil

    from click.testing import CliRunner
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    import tinkergym.tinker_api.server as server_module
    from tinkergym.cli import main

    serve_tinker_cli = importlib.import_module("tinkergym.cli.serve.tinker")  # the package's attribute of that name is the command

    cache = tmp_path / "cache"
    shutil.copytree(tiny, cache / "models" / "tiny")  # as `resolve_model("tiny")` leaves it
    monkeypatch.setenv("TINKERGYM_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offered: dict[str, str] = {}
    monkeypatch.setattr(server_module, "create_front_door", lambda url, offers, *args, **kwargs: offered.update(offers))
    monkeypatch.setattr(serve_tinker_cli, "run_server", lambda *args, **kwargs: None)
    done = CliRunner().invoke(main, ["serve", "tinker", "--scheduler", "http://127.0.0.1:9", "--offer", "tiny", "--offer", tiny, "--offer",
                                     "org/model", "--offer", "mystery", "--offer", "named=org/tok", "--run-dir", str(tmp_path / "runs"),
                                     "--data-dir", str(tmp_path / "data")], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert offered == {"tiny": str(cache / "models" / "tiny"), tiny: tiny, "org/model": "org/model", "mystery": "mystery", "named": "org/tok"}
    warnings = [line for line in done.output.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --offer mystery: tinkergym knows no model of that name; clients will load its tokenizer 'mystery' "
                        "from the Hugging Face hub. Name one they can read with --offer mystery=FOLDER (or =HUB_ID)."], done.output
    assert _load_tokenizer_from_model_info("tiny", offered["tiny"]).encode("hello")  # what get_tokenizer() does with get_info's answer


def test_without_torch_an_offer_of_tiny_keeps_its_name_and_warns(tmp_path: Path) -> None:
    """A front door installed without torch does not build tiny (nor convert smollm2-135m) to name its folder: the name stays
    (smollm2-135m's hub id), with the warning, and torch is never imported."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    code = ("import json, sys\nfrom tinkergym.tinker_api.cluster import offered_tokenizer\n"
            "print(json.dumps([offered_tokenizer(m) for m in ('tiny', 'smollm2-135m')] + ['torch' in sys.modules and sys.modules['torch'] is not None]))")
    env = {**os.environ, "TINKERGYM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(filter(None, (str(blocker), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (tiny_name, tiny_warning), (smol_name, smol_warning), imported = json.loads(done.stdout.splitlines()[-1])
    assert tiny_name == "tiny" and "making its folder here needs torch" in tiny_warning and "--offer tiny=FOLDER" in tiny_warning
    assert smol_name == "HuggingFaceTB/SmolLM2-135M-Instruct" and "from the Hugging Face hub" in smol_warning
    assert not imported and not (tmp_path / "cache" / "models").exists()
