"""Scheduler fixtures: a database URL, an app on it, and keys.

``db_url`` is a fresh SQLite file per test. (PostgreSQL joins as a second parameter where a server runs.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("alembic")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tinkergym.scheduler.app import SchedulerSettings, create_app  # noqa: E402
from tinkergym.scheduler.auth import create_key  # noqa: E402
from tinkergym.scheduler.db import make_engine, upgrade  # noqa: E402


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A fresh, empty database."""
    return f"sqlite:///{tmp_path / 'scheduler.db'}"


@dataclass
class Keys:
    """Keys made on the database (as ``tinkergym scheduler keys create`` does): ``new(tenant, scopes)`` -> key."""

    db_url: str

    def new(self, tenant: str = "acme", scopes: str = "read,write") -> str:
        engine = make_engine(self.db_url)
        try:
            upgrade(engine)
            return create_key(engine, tenant, scopes.split(","))[1]
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
        settings = SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", **overrides)
        client = TestClient(create_app(settings, background=background))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
