"""What a run of the cluster simulator (``scheduler_scale.py``) reads of its database and of the machine: a SQLite file
or a database on the private PostgreSQL cluster, its ``pg_stat_statements`` and query plans, and the CPU seconds of
the scheduler's process and of PostgreSQL's."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone); ``children``: with those of its children
    that have ended (a PostgreSQL backend's, once its connection closed, are its postmaster's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """CPU seconds of every ``postgres`` process on the machine (the private cluster's, while it alone runs), those of its
    ended backends included: without them a closed connection took its CPU out of the sum."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in ("postgres", "postmaster"):
                    total += cpu_seconds(int(entry.name), children=True)
            except OSError:
                continue
    return total


class Database:
    """The database of one run: a SQLite file, or a new database on the private PostgreSQL cluster."""

    def __init__(self, kind: str, scratch: Path, server: Any = None) -> None:
        self.kind, self.server = kind, server
        self.url = f"sqlite:///{scratch / 'scheduler.db'}" if kind == "sqlite" else server.new_database()

    def statements(self) -> dict[str, Any] | None:
        """Statements and rows so far (``pg_stat_statements``; None on SQLite): calls, rows, shared blocks read or hit."""
        if self.kind != "postgresql":
            return None
        import psycopg

        with psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            row = conn.execute("SELECT coalesce(sum(calls),0), coalesce(sum(rows),0), coalesce(sum(shared_blks_hit + shared_blks_read),0) "
                               "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
            tables = conn.execute("SELECT coalesce(sum(seq_tup_read),0), coalesce(sum(idx_tup_fetch),0) FROM pg_stat_user_tables").fetchone()
        return {"calls": int(row[0]), "rows": int(row[1]), "blocks": int(row[2]), "seq_rows": int(tables[0]), "index_rows": int(tables[1])}

    def top_statements(self, n: int = 8) -> list[dict[str, Any]]:
        if self.kind != "postgresql":
            return []
        import psycopg

        with psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            rows = conn.execute("SELECT calls, rows, total_exec_time, shared_blks_hit + shared_blks_read, left(regexp_replace(query, '\\s+', ' ', 'g'), 160) "
                                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                                "ORDER BY total_exec_time DESC LIMIT %s", (n,)).fetchall()
        return [{"calls": r[0], "rows": r[1], "ms": round(r[2], 1), "blocks": r[3], "query": r[4]} for r in rows]

    def plans(self) -> dict[str, list[str]]:
        """``EXPLAIN ANALYZE`` of reading the queue: the head of every tenant's queue (a lease request's read) and the
        first page of the whole queue in one order (what a scan of the queue in priority order costs)."""
        if self.kind != "postgresql":
            return {}
        import psycopg

        found = {}
        with psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            for name, sql in PLANS.items():
                found[name] = [row[0] for row in conn.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + sql)]
        return found

    def reset_statements(self) -> None:
        if self.kind != "postgresql":
            return
        import psycopg

        with psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")


PLANS = {
    "tenant_heads": "SELECT head.* FROM tenants JOIN LATERAL (SELECT id, tenant_id, priority, created_at, gpus FROM jobs "
                    "WHERE jobs.tenant_id = tenants.id AND jobs.state = 'queued' ORDER BY priority DESC, created_at, id LIMIT 8) AS head ON true",
    "queue_page": "SELECT id, tenant_id, priority, created_at, gpus FROM jobs WHERE state = 'queued' "
                  "ORDER BY priority DESC, created_at ASC, id ASC LIMIT 200",
}


def with_statements(server: Any) -> None:
    """Make ``pg_stat_statements`` (preloaded at the cluster's start) countable in the benchmark's databases."""
    import psycopg

    from tinkergym.scheduler.devdb import PG_ROLE

    # In template1, so every database made for a run has it; its reset granted to the role the scheduler connects as.
    with psycopg.connect(host=str(server.socket_dir), port=server.port, user=server.superuser, dbname="template1", autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute(f"GRANT EXECUTE ON FUNCTION pg_stat_statements_reset TO {PG_ROLE}")


def requeue_delays(url: str, vanished: list[dict[str, Any]]) -> list[float]:
    """For each lease a vanished worker held: seconds from its vanishing to the job's state leaving that lease (the
    ``state`` event that ended that epoch), from the database's events."""
    from sqlalchemy import create_engine, text

    if not vanished:
        return []
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    delays = []
    with engine.connect() as conn:
        for lost in vanished:
            rows = conn.execute(text("SELECT created_at, data FROM events WHERE job_id = :j AND type = 'state' ORDER BY seq"), {"j": lost["job"]}).all()
            ended = [at for at, data in rows if json.loads(data).get("epoch") == lost["epoch"]
                     and json.loads(data).get("state") in ("queued", "failed", "cancelled", "succeeded")]
            if ended:
                delays.append(ended[0] - lost["at"])
            else:
                delays.append(math.inf)
    engine.dispose()
    return delays
