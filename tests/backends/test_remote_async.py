"""``async_steps`` through a training server (``serve backend``): the client takes snapshots of the server's weights and
its rollout thread samples from them while the trainer trains, every trained sample at most K versions old; the server
holds a bounded number of snapshots, and a shared server takes none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from testkit import Watched, add_graded_env, check_bounded_staleness, serving  # noqa: E402  # registered by tests/conftest.py
from tinkergym.backends.remote import RemoteBackend  # noqa: E402
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.config import TrainConfig  # noqa: E402
from tinkergym.errors import ConfigError  # noqa: E402
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, LossSpec, OptimParams, SampleRequest, SamplingParams  # noqa: E402
from tinkergym.serve.auth import token_digest  # noqa: E402
from tinkergym.trainers.session import TrainingRun  # noqa: E402

TOKEN = "r" * 40


class WatchedRemote(Watched, RemoteBackend):
    """The real RemoteBackend, watched (:class:`testkit.Watched`)."""


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path / "cache"))


def _server(tiny: str, folder: Path) -> Any:
    from tinkergym.serve.training.app import create_app

    backend = TorchBackend(TorchBackendConfig(model=tiny, dtype="float32", lora_rank=4, seed=0))
    return create_app(backend, run_dir=folder, token_digest=token_digest(TOKEN))


def test_a_remote_run_samples_ahead_from_the_servers_snapshots(tiny: str, fake_site: Any, tmp_path: Path) -> None:
    env = add_graded_env(fake_site)
    out = tmp_path / "run"
    with serving(_server(tiny, tmp_path / "server")) as url:
        watched = WatchedRemote(url, TOKEN, delay=0.3)
        config = TrainConfig(env=env, trainer="grpo", backend_url=url, steps=5, batch_size=2, group_size=4, max_turns=1, max_new_tokens=6,
                             lr=5e-2, checkpoint_every=5, transcripts_every=0, old_logprobs="sampler", async_steps=2, out=str(out))
        TrainingRun(config, backend=watched).run(progress=False)
        watched.close()
    check_bounded_staleness(watched, out, 2, steps=5)


def test_the_server_holds_its_newest_snapshots_and_samples_each_as_it_was(tiny: str, tmp_path: Path) -> None:
    request = SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), num_samples=2)
    with serving(_server(tiny, tmp_path / "server")) as url:
        remote = RemoteBackend(url, TOKEN)
        first = remote.sampling_snapshot()
        before = [[s.tokens for s in row] for row in remote.sample(request).sequences]
        remote.forward_backward(ForwardBackwardRequest([Datum([5, 6, 7, 8, 9], [0.0, 1.0, 1.0, 1.0, 1.0])], LossSpec("cross_entropy")))
        remote.optim_step(OptimParams(learning_rate=0.5))
        assert [[s.tokens for s in row] for row in remote.sample(request).sequences] != before
        assert [[s.tokens for s in row] for row in first.sample(request).sequences] == before and first.version == 0
        later = [remote.sampling_snapshot() for _ in range(8)]
        assert {s.version for s in later} == {1}
        with pytest.raises(ConfigError, match="is not held"):
            first.sample(request)
        assert later[0].sample(request).sequences  # the newest eight are held
        remote.close()


def test_a_shared_server_takes_no_snapshots(tiny: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.serve.training.shared import create_shared_app

    app = create_shared_app(SharedBase(SharedBaseConfig(model=tiny, dtype="float32")), run_dir=tmp_path / "shared", token_digest=token_digest(TOKEN))
    adapter = TestClient(app).post("/v1/adapters", headers={"Authorization": f"Bearer {TOKEN}"}, json={}).json()["token"]
    with serving(app) as url:
        remote = RemoteBackend(url, adapter)
        with pytest.raises(ConfigError, match="takes no snapshots"):
            remote.sampling_snapshot()
        request = SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=2))
        with pytest.raises(ConfigError, match="takes no snapshots"):
            remote._call("sample", {"request": request.to_dict(), "snapshot": "v0-1"})
        assert remote.sample(request).sequences  # the adapter goes on
        remote.close()


@pytest.mark.parametrize(("bad", "message"), [("../states/step_1", "must be a snapshot id"), ("v1-1\x00", "holds a NUL character"), ("v1-\ud800", "lone UTF-16 surrogate"),
                                              ("v1-1\n", "must be a snapshot id"), ("v\u0661-1", "must be a snapshot id"),
                                              ("v" * 300, "must be a snapshot id"), (7, "must be a snapshot id"), ("v0-999", "is not held")])
def test_a_malformed_snapshot_id_is_refused_before_anything_runs(tiny: str, tmp_path: Path, bad: Any, message: str) -> None:
    request = SampleRequest([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=1.0, seed=3), num_samples=1)
    with serving(_server(tiny, tmp_path / "server")) as url:
        remote = RemoteBackend(url, TOKEN)
        remote.sampling_snapshot()
        with pytest.raises(ConfigError, match=message):
            remote._call("sample", {"request": request.to_dict(), "snapshot": bad})
        assert remote.sample(request).sequences  # the server goes on
        remote.close()
