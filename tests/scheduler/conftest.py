"""Scheduler fixtures: a database URL (SQLite and PostgreSQL), an app on it, and keys.

``db_url`` is parametrized over ``sqlite`` (a fresh file per test) and ``postgresql`` (a fresh database per
test on a private cluster that :func:`postgres_server` starts once per session on 127.0.0.1), each already at the
newest schema: a copy of a database migrated once per session (``empty_db_url``: the same, empty, for the tests of
the migrations). The end-to-end tests
that run real processes (a scheduler, workers, training clients) pick one of the two with
``@pytest.mark.parametrize("db_url", [...], indirect=True)``: their database work is the calls the API-level tests
make on both, and they are spread over the two so that each database is driven end to end. Where the
PostgreSQL binaries are missing the ``postgresql`` parameter is skipped, except in CI (``CI`` set), where it
fails: ``make install`` installs them. Each test on PostgreSQL is marked ``postgres`` (``-m "not postgres"``
leaves them out). Every module here needs the ``scheduler`` extra (sqlalchemy, alembic, fastapi, uvicorn, httpx);
without it each is reported skipped, with the reason, and none is imported.

The helpers in ``workerkit.py`` (a fake clock, a worker on a TestClient, direct database reads) are loaded here
once, by path, and registered as the module ``workerkit``: with ``--import-mode=importlib`` no test folder is
on ``sys.path``, and pytest imports this file before the test modules beside it, which ``import workerkit``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Callable, Iterator

import pytest
import testkit  # registered by tests/conftest.py

# The scheduler extra: without it every test module here is reported skipped, with the reason, and none is imported.
REQUIRES = ("sqlalchemy", "alembic", "fastapi", "uvicorn", "httpx")
MISSING = testkit.import_problem(*REQUIRES)
pytest_pycollect_makemodule = testkit.folder_requires(*REQUIRES)

if not MISSING:
    from fastapi.testclient import TestClient

    from tinkergym.scheduler.app import SchedulerSettings, create_app
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.credentials import WorkerBounds, create_worker_key
    from tinkergym.scheduler.db import make_engine, upgrade
    from tinkergym.scheduler.devdb import PostgresServer, find_pg_bin, private_postgres


def load_workerkit() -> ModuleType:
    """``workerkit.py`` beside this file, loaded by path once and registered as the module ``workerkit``."""
    if "workerkit" not in sys.modules:
        spec = importlib.util.spec_from_file_location("workerkit", Path(__file__).with_name("workerkit.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["workerkit"] = module
        spec.loader.exec_module(module)
    return sys.modules["workerkit"]


if not MISSING:
    load_workerkit()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``postgres`` each test here on PostgreSQL: the ``postgresql`` parameter of ``db_url``, or the cluster itself."""
    folder = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(folder):
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "postgresql" in (params.get("db_url"), params.get("empty_db_url")) or "postgres_server" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.postgres)


def in_ci() -> bool:
    """True when the ``CI`` variable is set (to anything but empty, ``0`` or ``false``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A private cluster for the session (:func:`tinkergym.scheduler.devdb.private_postgres`)."""
    problem = None
    if find_pg_bin() is None:
        problem = "PostgreSQL is not installed (no initdb/pg_ctl): run `make install` (it installs the postgresql package)"
    else:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            problem = "psycopg is not installed: run `make install` (the dev extra has psycopg[binary])"
    if problem is not None:
        if in_ci():
            pytest.fail(f"{problem}; CI runs the scheduler tests on PostgreSQL too", pytrace=False)
        pytest.skip(problem)
    with private_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def sqlite_schema(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to the newest schema once per test process: each test's database is a copy of it."""
    path = tmp_path_factory.mktemp("schema") / "scheduler.db"
    migrate(f"sqlite:///{path}")  # the last connection's close checkpoints the WAL into the file: the file alone is the database
    return path


@pytest.fixture(scope="session")
def postgres_schema(postgres_server: PostgresServer) -> str:
    """A database on the session's cluster migrated to the newest schema once: each test's database is made from it
    (``CREATE DATABASE ... TEMPLATE``, a copy of its files)."""
    url = postgres_server.new_database()
    migrate(url)  # and disconnected: a template must have no other connection while it is copied
    return url.rsplit("/", 1)[1]


def migrate(url: str) -> None:
    """Upgrade the database at ``url`` to the newest schema, then close every connection to it."""
    engine = make_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()


def fresh_database(request: pytest.FixtureRequest, tmp_path: Path, migrated: bool) -> Iterator[str]:
    """A new database of the kind ``request.param`` names, empty or at the newest schema (copied from the session's)."""
    if request.param == "sqlite":
        path = tmp_path / "scheduler.db"
        if migrated:
            shutil.copyfile(request.getfixturevalue("sqlite_schema"), path)
        yield f"sqlite:///{path}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.new_database(template=request.getfixturevalue("postgres_schema") if migrated else None)
    try:
        yield url
    finally:
        server.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database at the newest schema: a SQLite file, or a new database on the session's PostgreSQL cluster,
    each a copy of one migrated once per session (what ``upgrade`` would make, without running the migrations again)."""
    yield from fresh_database(request, tmp_path, migrated=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database (no schema), for the tests of the migrations themselves."""
    yield from fresh_database(request, tmp_path, migrated=False)


@dataclass
class Keys:
    """Keys made on the database: ``new(tenant, scopes)`` -> a tenant's key (as ``tinkergym scheduler keys create`` makes
    it); ``worker(devices, ...)`` -> a worker credential (as ``tinkergym scheduler workers create`` makes it).

    ``new(tenant, "worker")`` is a worker credential for 64 devices of any kind and model that serves every tenant
    (``tenant`` is not its tenant: a worker credential belongs to the cluster)."""

    db_url: str

    def new(self, tenant: str = "acme", scopes: str = "read,write") -> str:
        if scopes == "worker":
            return self.worker(64)
        engine = make_engine(self.db_url)
        try:
            upgrade(engine)
            return create_key(engine, tenant, scopes.split(","))[1]
        finally:
            engine.dispose()

    def worker(self, devices: int = 64, kind: str | None = None, models: tuple[str, ...] | None = None,
               tenants: tuple[str, ...] | None = None) -> str:
        engine = make_engine(self.db_url)
        try:
            upgrade(engine)
            return create_worker_key(engine, WorkerBounds(devices, kind, models, tenants))[1]
        finally:
            engine.dispose()


@pytest.fixture
def keys(db_url: str) -> Keys:
    return Keys(db_url)


@pytest.fixture
def make_client(db_url: str, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """``make_client(**settings)``: a TestClient around a scheduler app on ``db_url`` (sweeper off unless ``background=True``)."""
    clients: list[TestClient] = []

    def make(background: bool = False, **overrides: Any) -> TestClient:
        overrides.setdefault("cache_s", 0.0)  # the grant order and the wait reasons read the tables at every request
        settings = SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", **overrides)
        client = TestClient(create_app(settings, background=background))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
