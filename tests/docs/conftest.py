"""The documentation's examples: ``docs_examples.py`` (the runner) loaded by path and registered as the module
``docs_examples`` (no test folder is on ``sys.path``), and the fixtures an example may ask for (``fixture=NAME``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

if "docs_examples" not in sys.modules:
    spec = importlib.util.spec_from_file_location("docs_examples", Path(__file__).with_name("docs_examples.py"))
    assert spec is not None and spec.loader is not None
    sys.modules["docs_examples"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["docs_examples"])


@pytest.fixture(scope="session")
def docs_scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A scheduler on 127.0.0.1 with SQLite in a temporary folder, and a tenant's key: the variables of ``fixture=scheduler``."""
    pytest.importorskip("sqlalchemy")
    from tinkergym.scheduler.app import SchedulerSettings, create_app
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import make_engine
    from tinkergym.serve.asgi import ThreadServer

    folder = tmp_path_factory.mktemp("docs-scheduler")
    db_url = f"sqlite:///{folder / 'scheduler.db'}"
    server = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=folder / "data")))
    try:
        engine = make_engine(db_url)
        _, key = create_key(engine, "docs", ["read", "write"], name="docs examples")
        engine.dispose()
        yield {"TINKERGYM_URL": server.url, "TINKERGYM_SCHEDULER": server.url, "TINKERGYM_API_KEY": key, "TINKERGYM_SCHEDULER_DB": db_url}
    finally:
        server.stop()


@pytest.fixture
def example_fixtures(request: pytest.FixtureRequest) -> Callable[[tuple[str, ...]], dict[str, str]]:
    """``provide(names)``: the environment variables of the named example fixtures, each built once per test process."""

    def provide(names: tuple[str, ...]) -> dict[str, str]:
        variables: dict[str, str] = {}
        for name in names:
            if name == "scheduler":
                variables.update(request.getfixturevalue("docs_scheduler"))
            elif name == "tiny-model":
                variables["TINY_MODEL"] = request.getfixturevalue("tiny")  # tests/conftest.py: built from a config
        return variables

    return provide


@pytest.fixture(scope="session")
def example_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINKERGYM_CACHE of every example run by this test process: its own keys and tokenizers, and the models of the
    suite's cache (``~/.cache/tinkergym/models`` unless TINKERGYM_CACHE says otherwise), which every test process shares:
    SmolLM2 is converted once for the whole run (the cache builds a model atomically, under a lock), not once a process."""
    from tinkergym.plumbing.folders import cache_root

    cache = tmp_path_factory.mktemp("docs-cache")
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models, target_is_directory=True)
    return cache
