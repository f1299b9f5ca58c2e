"""Shared fixtures: installable fake env distributions on a temporary ``sys.path`` entry, the tiny model, and more.

The helpers in ``testkit.py`` (waiting for a server, a training row, folder skips) are loaded here once, by path,
and registered as the module ``testkit``: with ``--import-mode=importlib`` no test folder is on ``sys.path``, and
pytest imports this file before every other conftest and test module, which ``import testkit``. The test folders
follow the packages: core, registry, trainers, backends, serve, scheduler, and the lanes gpu and vllm (their
conftests mark each of their tests), and packaging for what holds for the whole distribution.
"""

from __future__ import annotations

import importlib.util
import os
import sys


# One thread per test process for torch (OpenMP), BLAS and the tokenizers (TINKERGYM_TEST_THREADS=N for another count),
# set before anything imports torch or numpy, so that every server, worker and client a test starts inherits it:
# pytest-xdist runs one test process per core, and with their default pools (a thread per core each) the test
# processes and the servers they start would oversubscribe the cores many times over (measured in CHANGELOG.md: five
# CPU-bound test files took 99 s on two processes of one thread, 378 s on two of two threads).
os.environ.setdefault("TINKERGYM_TEST_THREADS", "1")
os.environ.update(dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"), os.environ["TINKERGYM_TEST_THREADS"]))
os.environ["TOKENIZERS_PARALLELISM"] = "false" if os.environ["TINKERGYM_TEST_THREADS"] == "1" else "true"
# vLLM's CPU engine would otherwise pin an OpenMP thread to every core, in each test process at once ("auto").
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"

import textwrap
from pathlib import Path
from collections.abc import Callable

import gymnasium as gym
import pytest

from tinkergym.registry import hub


def load_testkit() -> None:
    """``testkit.py`` beside this file, loaded by path once and registered as the module ``testkit``."""
    if "testkit" not in sys.modules:
        spec = importlib.util.spec_from_file_location("testkit", Path(__file__).with_name("testkit.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["testkit"] = module
        spec.loader.exec_module(module)


load_testkit()
import testkit  # noqa: E402 - registered just above

ENV_MODULE = '''
from tinkergym import TextEnv

class EchoEnv(TextEnv):
    """Echoes the action; reward 1 for "win". Terminates after 3 steps."""

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 1}}

    def _reset(self, options):
        self.t = 0
        return "say something", {}

    def _step(self, action):
        self.t += 1
        return f"you said {action[:50]!r}"[:100], float(action == "win"), self.t >= 3, False, {}
'''


class FakeSite:
    """A folder on ``sys.path`` holding fake distributions (``*.dist-info``) and their modules."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ids: list[str] = []

    def add(self, dist: str, envs: dict[str, str], module_code: str = ENV_MODULE, manifest: str | None = None, version: str = "1.0") -> None:
        """Add distribution ``dist`` declaring ``envs`` (id -> "module:attr") with module ``module_code``."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{env_id} = {value}" for env_id, value in envs.items())
        (info / "entry_points.txt").write_text(f"[tinkergym.envs]\n{lines}\n")
        for value in envs.values():
            package = self.root / value.split(":")[0].split(".")[0]
            if not package.exists():
                package.mkdir()
                (package / "__init__.py").write_text(textwrap.dedent(module_code))
                if manifest is not None:
                    (package / "tinkergym_envs.toml").write_text(textwrap.dedent(manifest))
        self.ids.extend(envs)


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeSite]:
    """A fake site folder; the hub is rescanned and the fake ids are unregistered afterwards."""
    site = FakeSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    before = dict(gym.registry)
    yield site
    for env_id in site.ids:  # only entries the fake packages made: Gymnasium's own (CartPole-v1) stay
        if env_id in before:
            gym.registry[env_id] = before[env_id]
        else:
            gym.registry.pop(env_id, None)
    for name in [m for m in sys.modules if m.startswith("fakeenv")]:
        del sys.modules[name]
    monkeypatch.undo()
    hub.discovery(refresh=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny causal LM with a chat-template tokenizer, built from a config once per test process (needs the ``train``
    extra). Tests read it and never write into its folder."""
    from tinkergym.backends.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2-VL with an image chat template and Qwen2-VL's image processor, built from a config once per test
    process (needs ``train``); read only."""
    from tinkergym.backends.models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


@pytest.fixture(params=["default", "every-length"])
def length_passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Shared-prompt rows in passes by length as the backend decides, or every distinct row length in a pass of its own."""
    if request.param == "every-length":
        from tinkergym.backends.torch import scoring as torch_scoring

        monkeypatch.setitem(torch_scoring.CHUNK_OVERHEAD_TOKENS, "cpu", 0)
    return request.param


@pytest.fixture
def serve_backend_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    """``build(*flags)``: the TorchBackendConfig ``tinkergym serve backend --model tiny ... *flags`` builds (no backend is made)."""
    import secrets

    from click.testing import CliRunner

    from tinkergym.backends.torch import backend as torch_backend
    from tinkergym.cli import main

    class Built(Exception):
        pass

    def fake_backend(config: object) -> None:
        raise Built(config)

    monkeypatch.setattr(torch_backend, "TorchBackend", fake_backend)
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)

    def build(*flags: str) -> object:
        args = ["serve", "backend", "--model", "tiny", "--token-file", str(token), "--run-dir", str(tmp_path / "server"), *flags]
        result = CliRunner().invoke(main, args)
        assert isinstance(result.exception, Built), result.output
        return result.exception.args[0]

    return build


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of a module that share a module-scoped fixture (a server, an engine, a trained run) run in one test process.

    A module-scoped fixture is built once per test process; under pytest-xdist (``--dist loadgroup``), tests of one
    module spread over the processes would each build it again (a vLLM server took 28 s, twice). Each such test goes
    into the ``xdist_group`` named after its module, unless it names a group itself (``testkit.group_by_module_fixtures``,
    checked with pytest-xdist by tests/packaging/test_test_lanes.py).
    """
    testkit.group_by_module_fixtures(items)


@pytest.fixture(autouse=True)
def _keep_umask() -> object:
    """A service command run in process (click's runner) makes the umask 077 for the rest of the process: restore it."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)
