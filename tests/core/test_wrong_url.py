"""A scheduler URL that points at a training server says so (and how to go on), not that the key was refused."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("uvicorn")

from click.testing import CliRunner

from tinkergym.serve.asgi import ThreadServer
from tinkergym.serve.training.app import create_app
from tinkergym.serve.auth import token_digest
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.cli import main
from tinkergym.client import SchedulerClient, SchedulerError

KEY = "tgk_0123456789ab_" + "A" * 43


def test_a_training_servers_url_given_as_the_scheduler_says_so(tiny: str, tmp_path: Path) -> None:
    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", device="cpu", lora_rank=4))
    server = ThreadServer(create_app(backend, run_dir=tmp_path / "run", token_digest=token_digest("t" * 40)))
    try:
        with pytest.raises(SchedulerError) as refused:
            SchedulerClient(server.url, KEY).list()
        assert "is a tinkergym training or inference server" in str(refused.value) and "refused the API key" not in str(refused.value)
        result = CliRunner().invoke(main, ["jobs", "list"], env={"TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": KEY})
        assert result.exit_code == 2 and "not the scheduler" in result.output and "tinkergym scheduler serve" in result.output
    finally:
        server.stop()
