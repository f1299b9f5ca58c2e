"""Backends are plugins as trainers are: the four built in are found through the entry-point group, a package that
declares one in that group trains with ``--backend NAME``, and a name that cannot work is refused before anything loads."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from tinkergym.backends import BUILT_IN, available_backends, backend_name, check_backend
from tinkergym.cli import main
from tinkergym.config import TrainConfig
from tinkergym.errors import ConfigError

PLUGIN = textwrap.dedent(
    """
    import json, os

    def build(request):
        from tinkergym.backends.torch import build as build_torch

        with open(os.environ["PLUGIN_LOG"], "a") as log:  # what the session handed the factory
            log.write(json.dumps({"model": request.config.model, "name": request.name, "backend": request.config.backend}) + "\\n")
        return build_torch(request)
    """
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution (a dist-info folder on sys.path) whose entry point registers the backend ``logged``."""
    site = tmp_path / "site"
    (site / "logged_backend-1.0.dist-info").mkdir(parents=True)
    (site / "logged_backend-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: logged-backend\nVersion: 1.0\n")
    (site / "logged_backend-1.0.dist-info" / "entry_points.txt").write_text("[tinkergym.backends]\nlogged = logged_backend:build\n")
    (site / "logged_backend.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    log = tmp_path / "plugin.jsonl"
    monkeypatch.setenv("PLUGIN_LOG", str(log))
    return log


def test_the_built_in_backends_are_registered_plugins() -> None:
    found = available_backends()
    assert set(BUILT_IN) <= set(found)
    assert {name: found[name].value for name in BUILT_IN} == {
        "torch": "tinkergym.backends.torch:build", "vllm": "tinkergym.backends.vllm:build",
        "remote": "tinkergym.backends.remote:build", "scheduled": "tinkergym.backends.scheduled:build",
    }
    assert all(callable(found[name].load()) for name in BUILT_IN)


@pytest.mark.parametrize(("settings", "name"), [
    ({}, "torch"), ({"sampler": "vllm"}, "vllm"), ({"backend_url": "http://127.0.0.1:8765"}, "remote"),
    ({"scheduler_url": "http://127.0.0.1:8780"}, "scheduled"), ({"backend": "logged"}, "logged"),
])
def test_a_runs_settings_choose_its_backend(settings: dict, name: str) -> None:
    assert backend_name(TrainConfig(env="tinker/Bandit-v0", **settings)) == name


def test_a_backend_that_cannot_work_is_refused(plugin: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'loged'\. Did you mean: logged\?.*Installed backends: .*logged"):
        check_backend(TrainConfig(env="tinker/Bandit-v0", backend="loged"))
    with pytest.raises(ConfigError, match="contradicts the run's settings, which train through 'scheduled'"):
        check_backend(TrainConfig(env="tinker/Bandit-v0", backend="torch", scheduler_url="http://127.0.0.1:8780"))
    check_backend(TrainConfig(env="tinker/Bandit-v0", backend="logged"))
    check_backend(TrainConfig(env="tinker/Bandit-v0", backend="torch"))


def test_train_goes_through_a_plugins_backend(plugin: Path, tiny: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--env", "tinker/Bandit-v0", "--model", tiny, "--steps", "1", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--dtype", "float32", "--quiet", "--out", str(out)]
    refused = CliRunner().invoke(main, [*args, "--backend", "nope"])
    assert refused.exit_code == 2 and "unknown backend 'nope'" in refused.output and "logged" in refused.output
    assert not out.exists() and not plugin.exists(), "refused before a run folder or a backend was made"

    done = CliRunner().invoke(main, [*args, "--backend", "logged"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    calls = [json.loads(line) for line in plugin.read_text().splitlines()]
    assert calls == [{"model": tiny, "name": "run", "backend": "logged"}]
    assert json.loads((out / "config.json").read_text())["backend"] == "logged"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1

    resumed = CliRunner().invoke(main, ["train", "--resume", str(out), "--steps", "2", "--quiet"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    assert len(plugin.read_text().splitlines()) == 2, "a resume builds the run's backend through the same plugin"
