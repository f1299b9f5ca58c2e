"""The scheduler's tables (SQLAlchemy 2 Core) and its engine: SQLite in WAL mode by default, PostgreSQL by URL.

Times are UNIX seconds (floats) taken from the scheduler's clock, so lease arithmetic is the same on every
database. The invariants the code relies on are constraints, so a bug or a race cannot break them:

- ``allocations.device_id`` is the primary key: a device is granted to at most one job at a time, whatever
  the code does (a second grant fails with an integrity error and its transaction rolls back, all or none);
- ``events (job_id, seq)`` is unique: an event is recorded once and a stream resumes without duplicates;
- ``idempotency (tenant_id, method, path, key)`` is the primary key: one first request per key;
- ``devices (worker_id, index)`` is unique: a worker registers each device (and each seat of a shared server) once.

The schema is created and upgraded by Alembic (``migrations/``; :func:`upgrade`), never by ``create_all``
outside tests of the migrations themselves.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy import exc as exc_module
from sqlalchemy.engine import Engine

metadata = MetaData()

#: The largest value an ``Integer`` column holds on every database (PostgreSQL's INTEGER is 32-bit signed): every
#: integer a request may store (epochs, steps, sequence numbers) is bounded by it at the edge, so a larger one is
#: answered 400, never a database error.
MAX_INT = 2**31 - 1

tenants = Table(
    "tenants", metadata,
    Column("id", String(64), primary_key=True),
    Column("max_gpus", Integer, nullable=False, default=8),  # devices held at once by the tenant's jobs
    Column("max_queued", Integer, nullable=False, default=100),  # jobs waiting at once
    Column("max_artifact_bytes", BigInteger, nullable=False, default=100 << 30),  # bytes its jobs' stored artifacts hold
    Column("max_events_per_job", Integer, nullable=False, default=100_000),
    Column("max_event_bytes", Integer, nullable=False, default=65536),  # one event's data, as JSON
    Column("keep_ended_jobs", Integer, nullable=False, default=1000),  # ended jobs kept; older ones are deleted
    Column("created_at", Float, nullable=False),
    # Device-seconds of its jobs that retention deleted (tinkergym.scheduler.usage): its usage outlives them.
    Column("retired_device_seconds", Float, nullable=False, default=0.0, server_default="0"),
    Column("retired_tokens_trained", BigInteger, nullable=False, default=0, server_default="0"),
    Column("retired_tokens_sampled", BigInteger, nullable=False, default=0, server_default="0"),
    # Idempotency-Key records (stored answers) the tenant may hold at once, by count and by bytes (tinkergym.scheduler.idempotency).
    Column("max_idempotency_records", Integer, nullable=False, default=10_000, server_default="10000"),
    Column("max_idempotency_bytes", BigInteger, nullable=False, default=64 << 20, server_default=str(64 << 20)),
    # Its share of the cluster against other tenants with work (tinkergym.scheduler.fairshare): 2 gets twice what 1 gets.
    Column("share", Float, nullable=False, default=1.0, server_default="1"),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(32), primary_key=True),  # the key's public prefix part: looked up, never secret
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("digest", String(64), nullable=False),  # SHA-256 of the whole key, hex; the key itself is never stored
    Column("scopes", String(200), nullable=False),  # comma-separated: read, write, admin, worker
    Column("name", String(200), nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
    # A worker credential's bounds (JSON: devices, kind, models, tenants); None for a tenant's key. Only the operator
    # makes one (``tinkergym scheduler workers create``), and only such a key holds the ``worker`` scope.
    Column("worker_bounds", Text, nullable=True),
)

workers = Table(
    "workers", metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("key_id", String(32), ForeignKey("api_keys.id"), nullable=False),
    Column("host", String(255), nullable=False),
    Column("models", Text, nullable=False, default="[]"),  # JSON list of the model names it serves
    Column("registered_at", Float, nullable=False),
    Column("last_seen_at", Float, nullable=False),
    Column("strikes", Integer, nullable=False, default=0),  # leases in a row that expired before the job's server came up
    Column("quarantined_at", Float, nullable=True),  # set at quarantine_after strikes: no more leases until released
    Column("quarantine_reason", Text, nullable=True),  # why: its strikes, or the fault it reported giving a job back
    # Leases it lost while it kept calling, counted in a window from losses_since (tinkergym.scheduler.worker_registry._count_loss).
    Column("losses", Integer, nullable=False, default=0, server_default="0"),
    Column("losses_since", Float, nullable=True),
    Column("model_shapes", Text, nullable=True),  # JSON: model name -> its shape (tinkergym.scheduler.memory), for the models it counted
)

devices = Table(
    "devices", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("worker_id", String(64), ForeignKey("workers.id"), nullable=False),
    Column("index", Integer, nullable=False),  # CUDA_VISIBLE_DEVICES index on the worker (or a CPU slot number); a seat's: seats.seat_index
    Column("kind", String(16), nullable=False),  # "gpu" or "slot" (a seat's: the device's it sits on)
    Column("name", String(200), nullable=False, default=""),
    Column("active", Boolean, nullable=False, default=True),
    # A seat on a shared training server (tinkergym.scheduler.seats): the index of the device it sits on, and the
    # server's base as JSON (model, dtype, max_lora_rank). Both None for a whole device.
    Column("seat_of", Integer, nullable=True),
    Column("shared", Text, nullable=True),
    Column("memory_bytes", BigInteger, nullable=True),  # what the worker said the device holds (None: not said, not checked)
    # What the server on the device measured at its job's last heartbeat (tinkergym.plumbing.memory_use; a seat's row:
    # its shared server's, the same on every seat of the device): device bytes now, at the peak, its size; the host's
    # now and peak; a shared server's base alone. None: not measured yet.
    Column("used_bytes", BigInteger, nullable=True),
    Column("peak_bytes", BigInteger, nullable=True),
    Column("measured_total_bytes", BigInteger, nullable=True),
    Column("host_bytes", BigInteger, nullable=True),
    Column("host_peak_bytes", BigInteger, nullable=True),
    Column("base_bytes", BigInteger, nullable=True),
    Column("measured_at", Float, nullable=True),
    UniqueConstraint("worker_id", "index", name="uq_devices_worker_index"),
)

# What a seat job really keeps on a worker's shared servers, per model: the factor its priced bytes are multiplied by
# (tinkergym.scheduler.memory.learned_factor), learned from that worker's measures at heartbeats (a worker's measures
# move its own placement alone). Deleted with the worker.
memory_factors = Table(
    "memory_factors", metadata,
    Column("worker_id", String(64), ForeignKey("workers.id"), primary_key=True),
    Column("model", String(200), primary_key=True),
    Column("factor", Float, nullable=False),
    Column("samples", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
)

jobs = Table(
    "jobs", metadata,
    Column("id", String(40), primary_key=True),
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("state", String(16), nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("gpus", Integer, nullable=False),
    Column("config", Text, nullable=False),  # the TrainConfig (or serving config) as JSON
    Column("name", String(200), nullable=False, default=""),
    Column("attempt", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("error", Text, nullable=True),
    # The lease: one at a time per job. The epoch only grows (every grant adds one) and fences every write.
    Column("lease_epoch", Integer, nullable=False, default=0),
    Column("worker_id", String(64), ForeignKey("workers.id"), nullable=True),
    Column("lease_expires_at", Float, nullable=True),
    Column("server_url", String(500), nullable=True),
    Column("server_token_digest", String(64), nullable=True),
    Column("cursor", Integer, nullable=False, default=0),  # last event seq, so appends number without a scan
    Column("artifact_bytes", BigInteger, nullable=False, default=0),  # bytes its stored artifacts hold (the tenant's quota)
    # Devices held times seconds (a seat counts its share of its device), added at each renewal (tinkergym.scheduler.usage).
    Column("device_seconds", Float, nullable=False, default=0.0, server_default="0"),
    # Tokens its servers trained and sampled, and the last totals a server reported ({"epoch", "tokens_trained", ...}).
    Column("tokens_trained", BigInteger, nullable=False, default=0, server_default="0"),
    Column("tokens_sampled", BigInteger, nullable=False, default=0, server_default="0"),
    Column("usage_reported", Text, nullable=True),
)
Index("ix_jobs_queue", jobs.c.state, jobs.c.priority, jobs.c.created_at)
Index("ix_jobs_tenant", jobs.c.tenant_id, jobs.c.created_at)
Index("ix_jobs_lease", jobs.c.state, jobs.c.lease_expires_at)
Index("ix_jobs_tenant_state", jobs.c.tenant_id, jobs.c.state)
Index("ix_jobs_tenant_queue", jobs.c.tenant_id, jobs.c.state, jobs.c.priority.desc(), jobs.c.created_at, jobs.c.id)  # a tenant's queue, in order
Index("ix_jobs_state_finished", jobs.c.state, jobs.c.finished_at)  # the retention pass: ended jobs by age

allocations = Table(
    "allocations", metadata,
    Column("device_id", Integer, ForeignKey("devices.id"), primary_key=True),  # never a device (or a seat) twice
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("granted_at", Float, nullable=False),
)
Index("ix_allocations_job", allocations.c.job_id)

events = Table(
    "events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("type", String(40), nullable=False),
    Column("data", Text, nullable=False),  # JSON object
    Column("created_at", Float, nullable=False),
    UniqueConstraint("job_id", "seq", name="uq_events_job_seq"),
)

checkpoints = Table(
    "checkpoints", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(40), ForeignKey("jobs.id"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("name", String(200), nullable=False),  # a folder name inside the job's artifact folder
    Column("epoch", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("job_id", "name", name="uq_checkpoints_job_name"),
)

idempotency = Table(
    "idempotency", metadata,
    Column("tenant_id", String(64), primary_key=True),
    Column("method", String(8), primary_key=True),
    Column("path", String(300), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("body_digest", String(64), nullable=False),
    Column("status", Integer, nullable=True),  # None while the first request is in flight
    Column("response", Text, nullable=True),
    Column("created_at", Float, nullable=False),
)
Index("ix_idempotency_created", idempotency.c.created_at)  # the retention pass: records past their TTL


def database_url(url: str | None, default_dir: str | Path) -> str:
    """``url``, or the SQLite file ``scheduler.db`` in ``default_dir``."""
    if url:
        return url
    path = Path(default_dir).resolve() / "scheduler.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``. SQLite: WAL journal, foreign keys on, a 30 s busy timeout, ``BEGIN IMMEDIATE`` transactions.

    ``BEGIN IMMEDIATE`` takes SQLite's write lock when a transaction starts rather than at its first write,
    so two read-then-write transactions cannot both read and then fail to upgrade (SQLite's answer to
    ``SELECT ... FOR UPDATE``); PostgreSQL gets ``FOR UPDATE`` where a transaction reads what it will change.
    """
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    if not url.startswith("sqlite"):
        engine = create_engine(url, future=True, **kwargs)
        _ping_idle_connections(engine)
        return engine
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, future=True, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN is off: ours below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Reads (reader(engine)) take a snapshot without the write lock: WAL readers never wait for writers.
        # On the driver's connection: SQLAlchemy's own execution path costs more than SQLite's BEGIN does.
        connection.connection.driver_connection.execute("BEGIN" if connection.get_execution_options().get(_READ_OPTION) else "BEGIN IMMEDIATE")

    _WRITE_LOCKS[engine] = threading.RLock()  # re-entrant: a transaction may run inside another on the same thread
    return engine


#: A pooled connection idle longer than this is pinged before use (one round trip), and replaced if the server dropped it.
PING_AFTER_IDLE_S = 5.0


def _ping_idle_connections(engine: Engine) -> None:
    """``pool_pre_ping``, for connections idle longer than :data:`PING_AFTER_IDLE_S` only.

    A ping on every checkout is a round trip per transaction; a busy server reuses its connections within
    milliseconds, and a connection the server dropped since (it restarted) fails its statement, and SQLAlchemy
    then replaces the pool's connections.
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since <= PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:  # noqa: BLE001 - any failure: the pool opens a new connection instead
            raise exc_module.DisconnectionError(f"a pooled connection failed its ping ({type(exc).__name__})") from exc


_READ_OPTION = "tinkergym_read_only"
_READERS: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()
_WRITE_LOCKS: weakref.WeakKeyDictionary[Engine, threading.RLock] = weakref.WeakKeyDictionary()
_AUTOCOMMIT_READERS: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()


def reader(engine: Engine) -> Engine:
    """``engine`` for reads only: on SQLite its transactions take a snapshot instead of the write lock (elsewhere the same engine)."""
    if not is_sqlite(engine):
        return engine
    found = _READERS.get(engine)
    if found is None:
        found = _READERS[engine] = engine.execution_options(**{_READ_OPTION: True})
    return found


def autocommit_reader(engine: Engine) -> Engine:
    """``engine`` for reads of one statement each, outside any transaction (no ``BEGIN``, no ``ROLLBACK``: one
    round trip fewer on PostgreSQL); on SQLite, :func:`reader` (a statement run by :class:`Prepared` on it is its own
    snapshot)."""
    if is_sqlite(engine):
        return reader(engine)
    found = _AUTOCOMMIT_READERS.get(engine)
    if found is None:
        found = _AUTOCOMMIT_READERS[engine] = engine.execution_options(isolation_level="AUTOCOMMIT")
    return found


def write_lock(engine: Engine) -> Any:
    """A lock that lets one of this process's threads write at a time on SQLite (so they queue here instead of in
    SQLite's busy handler, which sleeps in steps of up to 100 ms); a no-op elsewhere."""
    return _WRITE_LOCKS.get(engine) or contextlib.nullcontext()


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


class Prepared:
    """A statement compiled once per dialect and run on the driver's cursor of a SQLAlchemy connection, in its transaction.

    For the few statements on the hot path of a job submission, where SQLAlchemy's work per execution (a cache key,
    an execution context, a result object) costs several times what the database does. ``statement`` is a Core
    statement, or a function of the dialect's name that builds one; its parameters are :func:`~sqlalchemy.bindparam`
    names, given as a dict (SQLite gets ``:name``, psycopg ``%(name)s``); literals in it keep their values. Values go
    to the driver as they are, with no type processing: plain strings, numbers and None only.
    """

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self._compiled: dict[str, tuple[str, dict[str, Any]]] = {}

    def sql(self, dialect: Any) -> tuple[str, dict[str, Any]]:
        """The statement's SQL in ``dialect`` and the values of its literals (compiled on first use)."""
        found = self._compiled.get(dialect.name)
        if found is None:
            statement = self.statement(dialect.name) if callable(self.statement) else self.statement
            name = dialect.name
            if name == "sqlite":
                from sqlalchemy.dialects import sqlite

                dialect = sqlite.dialect(paramstyle="named")  # sqlite3 takes a dict for :name parameters
            compiled = statement.compile(dialect=dialect)
            literals = {k: v for k, v in compiled.params.items() if v is not None}
            found = self._compiled[name] = (str(compiled), literals)
        return found

    def rows(self, conn: Any, params: dict[str, Any]) -> list[tuple]:
        """Run it on ``conn`` (a :class:`~sqlalchemy.engine.Connection` in a transaction) and fetch every row."""
        sql, literals = self.sql(conn.dialect)
        cursor = conn.connection.cursor()
        try:
            cursor.execute(sql, {**literals, **params} if literals else params)
            return cursor.fetchall()
        finally:
            cursor.close()

    def run(self, conn: Any, params: dict[str, Any]) -> int:
        """Run it on ``conn`` (a :class:`~sqlalchemy.engine.Connection` in a transaction): the rows it changed."""
        sql, literals = self.sql(conn.dialect)
        cursor = conn.connection.cursor()
        try:
            cursor.execute(sql, {**literals, **params} if literals else params)
            return cursor.rowcount
        finally:
            cursor.close()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Create or upgrade the schema with the Alembic migrations shipped in this package."""
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def alembic_config(engine: Engine) -> Any:
    """An Alembic config for ``engine`` with this package's ``migrations`` folder (no alembic.ini needed)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    config.attributes["engine"] = engine
    return config


def current_revision(engine: Engine) -> str | None:
    """The database's Alembic revision (None for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
