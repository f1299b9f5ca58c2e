"""The scheduler's database from the command line: ``--db`` and ``--data-dir``, and opening (and migrating) it, for every
``tinkergym scheduler`` command and ``tinkergym serve tinker``.

SQLAlchemy and Alembic are imported inside the functions, so ``import tinkergym.cli`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from tinkergym.cli.common import InputError, SafePath, shorten

DB_ENVVAR = "TINKERGYM_SCHEDULER_DB"
DEFAULT_DATA_DIR = Path("scheduler-data")

db_option = click.option(
    "--db", "db", default=None, envvar=DB_ENVVAR, show_envvar=True, metavar="URL",
    help="SQLAlchemy URL: sqlite:///path/scheduler.db or postgresql://user@host:5432/name (default: <data-dir>/scheduler.db).",
)
data_dir_option = click.option(
    "--data-dir", type=SafePath(file_okay=False, path_type=Path), default=DEFAULT_DATA_DIR, show_default=True,
    help="The scheduler's folder: artifacts, scheduler.log and the default SQLite database.",
)


def shown_url(url: str) -> str:
    """``url`` with any password masked, for messages and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return shorten(url, 200)


def _reason(exc: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's background link."""
    inner = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return shorten(lines[0] if lines else type(inner).__name__, 300)


def open_database(db: str | None, data_dir: Path, *, migrate: bool = True) -> Any:
    """An engine on the scheduler's database (upgraded to the newest schema when ``migrate``); a bad URL or an
    unreachable server is an :class:`InputError` (exit 2)."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from tinkergym.scheduler.db import database_url, make_engine, upgrade

    try:
        url = database_url(db, data_dir)
    except OSError as exc:
        raise InputError(f"cannot create the data folder {str(data_dir)!r}: {exc.strerror or exc}") from exc
    try:
        engine = make_engine(url)
        with engine.connect():
            pass
        if migrate:
            upgrade(engine)
    except (SQLAlchemyError, CommandError, ValueError, ImportError, OSError) as exc:
        raise InputError(
            f"cannot use the database {shown_url(url)}: {_reason(exc)}. Check --db (or ${DB_ENVVAR}): "
            "sqlite:///path/scheduler.db, or postgresql://user@host:5432/name with the server running"
        ) from exc
    return engine
