"""The Alembic migrations, on SQLite and PostgreSQL: an empty database upgrades to exactly ``db.metadata``; a
database at the first revision keeps its rows through the upgrade; downgrade and upgrade again work; the app
factory upgrades an older database before it serves it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from tinkergym.scheduler import db
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.scheduler.auth import authenticate, key_digest
from tinkergym.scheduler.db import current_revision, make_engine, upgrade


def _head() -> str:
    return ScriptDirectory.from_config(db.alembic_config(None)).get_current_head()


def _family(type_: Any) -> tuple[str, int | None]:
    """A column type as the same thing on every database: (family, length)."""
    for family in (sa.Boolean, sa.Integer, sa.Float, sa.Text, sa.String):
        if isinstance(type_, family):
            length = getattr(type_, "length", None) if family is sa.String else None
            return family.__name__, length
    return type(type_).__name__, None


def _schema(source: Any) -> dict[str, Any]:
    """Tables, columns (type family, nullability), primary keys, foreign keys, unique constraints and indexes.

    ``source`` is an engine (reflected) or the metadata (declared), described the same way.
    """
    if isinstance(source, sa.MetaData):
        tables = source.tables.values()
        out: dict[str, Any] = {}
        for table in tables:
            out[table.name] = {
                "columns": {c.name: (_family(c.type), c.nullable) for c in table.columns},
                "primary_key": sorted(c.name for c in table.primary_key.columns),
                "foreign_keys": sorted((tuple(fk.parent.name for fk in con.elements), con.referred_table.name,
                                        tuple(fk.column.name for fk in con.elements)) for con in table.foreign_key_constraints),
                "unique": sorted((con.name, tuple(c.name for c in con.columns)) for con in table.constraints
                                 if isinstance(con, sa.UniqueConstraint)),
                "indexes": sorted((ix.name, tuple(c.name for c in ix.columns), bool(ix.unique)) for ix in table.indexes),
            }
        return out
    inspector = inspect(source)
    out = {}
    for name in inspector.get_table_names():
        if name == "alembic_version":
            continue
        out[name] = {
            "columns": {c["name"]: (_family(c["type"]), c["nullable"]) for c in inspector.get_columns(name)},
            "primary_key": sorted(inspector.get_pk_constraint(name)["constrained_columns"]),
            "foreign_keys": sorted((tuple(fk["constrained_columns"]), fk["referred_table"], tuple(fk["referred_columns"]))
                                   for fk in inspector.get_foreign_keys(name)),
            "unique": sorted((u["name"], tuple(u["column_names"])) for u in inspector.get_unique_constraints(name)),
            # PostgreSQL lists the index behind each unique constraint too: those are the constraints above.
            "indexes": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"])) for ix in inspector.get_indexes(name)
                              if "duplicates_constraint" not in ix),
        }
    return out


def _autogenerate_diff(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(context, db.metadata)


def test_an_empty_database_upgrades_to_the_declared_schema(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        assert current_revision(engine) is None
        upgrade(engine)
        assert current_revision(engine) == _head()
        assert _schema(engine) == _schema(db.metadata)
        assert _autogenerate_diff(engine) == []
        upgrade(engine)  # a second upgrade is a no-op
        assert current_revision(engine) == _head()
    finally:
        engine.dispose()


# Rows as revision 0001 stores them (its columns only): a tenant, a key, two jobs, their events, an idempotency record.
KEY = "tgk_0123456789ab_" + "A" * 43
T0 = 1_700_000_000.0


def _fill_first_revision(conn: sa.Connection) -> None:
    conn.execute(text("INSERT INTO tenants (id, max_gpus, max_queued, created_at) VALUES ('acme', 4, 10, :t)"), {"t": T0})
    conn.execute(text("INSERT INTO api_keys (id, tenant_id, digest, scopes, name, created_at, revoked_at) "
                      "VALUES ('0123456789ab', 'acme', :d, 'read,write', 'laptop', :t, NULL)"), {"d": key_digest(KEY), "t": T0})
    for n, state in enumerate(("queued", "succeeded")):
        conn.execute(text(
            "INSERT INTO jobs (id, tenant_id, kind, state, priority, gpus, config, name, attempt, max_attempts, created_at, "
            "updated_at, finished_at, error, cursor) VALUES (:id, 'acme', 'train', :state, 5, 2, :config, :name, 1, 3, :t, :t, "
            ":finished, NULL, 2)"),
            {"id": f"job_old{n}", "state": state, "config": json.dumps({"env": "tinker/Bandit-v0", "steps": 3}), "name": f"old-{n}",
             "t": T0 + n, "finished": T0 + 9 if state == "succeeded" else None})
        for seq in (1, 2):
            conn.execute(text("INSERT INTO events (job_id, seq, type, data, created_at) VALUES (:j, :s, 'log', :d, :t)"),
                         {"j": f"job_old{n}", "s": seq, "d": json.dumps({"line": f"event {seq}"}), "t": T0 + seq})
    conn.execute(text("INSERT INTO idempotency (tenant_id, method, path, key, body_digest, status, response, created_at) "
                      "VALUES ('acme', 'POST', '/v1/jobs', 'retry-1', :b, 201, :r, :t)"),
                 {"b": "b" * 64, "r": json.dumps({"id": "job_old0"}), "t": T0})


def _rows(conn: sa.Connection, table: str, columns: str, order: str) -> list[tuple]:
    return [tuple(r) for r in conn.execute(text(f"SELECT {columns} FROM {table} ORDER BY {order}"))]


OLD_COLUMNS = {
    "tenants": ("id, max_gpus, max_queued, created_at", "id"),
    "api_keys": ("id, tenant_id, digest, scopes, name, created_at, revoked_at", "id"),
    "jobs": (("id, tenant_id, kind, state, priority, gpus, config, name, attempt, max_attempts, created_at, updated_at, "
              "finished_at, error, cursor"), "id"),
    "events": ("job_id, seq, type, data, created_at", "job_id, seq"),
    "idempotency": ("tenant_id, method, path, key, body_digest, status, response, created_at", "key"),
}


def test_rows_of_the_first_revision_survive_the_upgrade(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(engine, "0001")
        assert current_revision(engine) == "0001"
        with engine.begin() as conn:
            _fill_first_revision(conn)
        with engine.connect() as conn:
            before = {table: _rows(conn, table, *spec) for table, spec in OLD_COLUMNS.items()}
        assert all(before.values())
        upgrade(engine)
        assert current_revision(engine) == _head()
        with engine.connect() as conn:
            after = {table: _rows(conn, table, *spec) for table, spec in OLD_COLUMNS.items()}
            leases = _rows(conn, "jobs", "id, lease_epoch, worker_id, lease_expires_at, server_url, server_token_digest", "id")
        assert after == before
        assert leases == [("job_old0", 0, None, None, None, None), ("job_old1", 0, None, None, None, None)]
        assert _schema(engine) == _schema(db.metadata)
        principal = authenticate(engine, KEY)
        assert principal is not None and principal.tenant_id == "acme" and principal.scopes == {"read", "write"}
    finally:
        engine.dispose()


def test_downgrade_to_base_and_up_again(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (id, max_gpus, max_queued, created_at) VALUES ('acme', 1, 1, 0)"))
        from alembic import command

        command.downgrade(db.alembic_config(engine), "0001")
        assert current_revision(engine) == "0001"
        assert "workers" not in inspect(engine).get_table_names()
        assert "lease_epoch" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
        with engine.connect() as conn:  # a downgrade to the first revision keeps what that revision has
            assert _rows(conn, "tenants", "id", "id") == [("acme",)]
        command.downgrade(db.alembic_config(engine), "base")
        assert current_revision(engine) is None
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        upgrade(engine)
        assert current_revision(engine) == _head()
        assert _schema(engine) == _schema(db.metadata)
    finally:
        engine.dispose()


def test_create_app_upgrades_an_older_database(empty_db_url: str, tmp_path: Path) -> None:
    engine = make_engine(empty_db_url)
    try:
        upgrade(engine, "0001")
        with engine.begin() as conn:
            _fill_first_revision(conn)
    finally:
        engine.dispose()
    app = create_app(SchedulerSettings(db_url=empty_db_url, data_dir=tmp_path / "data"), background=False)
    with TestClient(app) as client:
        engine = make_engine(empty_db_url)
        try:
            assert current_revision(engine) == _head()
        finally:
            engine.dispose()
        headers = {"Authorization": f"Bearer {KEY}"}
        listed = client.get("/v1/jobs", headers=headers)
        assert listed.status_code == 200, listed.text
        assert sorted(j["id"] for j in listed.json()["jobs"]) == ["job_old0", "job_old1"]
        job = client.get("/v1/jobs/job_old1", headers=headers).json()
        assert job["state"] == "succeeded" and job["lease_epoch"] == 0 and job["config"]["steps"] == 3
        events = client.get("/v1/jobs/job_old0/events", headers=headers)
        assert events.status_code == 200 and [e["seq"] for e in events.json()["events"]] == [1, 2]
        # The upgraded database takes new work beside the old.
        body = {"kind": "train", "gpus": 1, "config": {"model": "tiny", "env": "tinker/Bandit-v0"}}
        made = client.post("/v1/jobs", headers=headers, json=body)
        assert made.status_code == 201, made.text
        assert made.json()["state"] == "queued" and made.json()["lease_epoch"] == 0
        # The old idempotency record still holds its key: the same key with another body is refused.
        reused = client.post("/v1/jobs", headers={**headers, "Idempotency-Key": "retry-1"}, json=body)
        assert reused.status_code == 422, reused.text
