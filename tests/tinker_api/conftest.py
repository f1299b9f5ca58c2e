"""The Tinker API served on the tiny model, with a scheduler key database of three tenants (alice and bob train, carol reads)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from testkit import serving  # registered by tests/conftest.py


@dataclass
class Cluster:
    url: str
    model: str
    keys: dict[str, str]  # tenant -> "tml-..." key
    base: Any
    service: Any  # the TinkerService (its engine's shared worker: service.engine.worker)
    metrics: Any  # the app's ServerMetrics (serve tinker --metrics-port serves them)

    def client(self, who: str = "alice") -> Any:
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=self.keys[who])


@pytest.fixture(scope="module")
def cluster(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``serve tinker``'s app on the tiny model (named ``tiny-test``) at ``cluster.url``; ``cluster.keys`` by tenant."""
    pytest.importorskip("tinker")
    pytest.importorskip("sqlalchemy")
    from tinkergym.backends.torch.shared import SharedBase, SharedBaseConfig
    from tinkergym.scheduler.auth import create_key
    from tinkergym.scheduler.db import make_engine, upgrade
    from tinkergym.tinker_api.server import create_server

    root = tmp_path_factory.mktemp("tinker")
    engine = make_engine(f"sqlite:///{root / 'keys.db'}")
    upgrade(engine)
    keys = {name: "tml-" + create_key(engine, name, scopes)[1] for name, scopes in
            (("alice", ["read", "write"]), ("bob", ["read", "write"]), ("carol", ["read"]))}
    base = SharedBase(SharedBaseConfig(model=tiny, dtype="float32", micro_batch_size=16, max_sessions=48))
    app = create_server(base, root / "runs", engine, logging.getLogger("tinker-test"), model_name="tiny-test", tokenizer_id=tiny,
                        max_runs_per_tenant=64)
    with serving(app) as url:
        yield Cluster(url, "tiny-test", keys, base, app.state.tinker, app.state.metrics)
    engine.dispose()




@pytest.fixture
def connect(cluster: Cluster) -> Iterator[Any]:
    """``connect(who)``: a ServiceClient of ``who``'s key; each is closed (its session finished, its runs freed) after the test."""
    made: list[Any] = []

    def make(who: str = "alice") -> Any:
        made.append(cluster.client(who))
        return made[-1]

    yield make
    for client in made:
        client.close("success").result()
