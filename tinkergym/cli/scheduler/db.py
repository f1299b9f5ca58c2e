"""``tinkergym scheduler db``: the scheduler's database schema (Alembic migrations shipped in the package)."""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database


@click.group("db")
def db_group() -> None:
    """The scheduler's database schema (Alembic migrations shipped in the package).

    \b
    Examples:
      tinkergym scheduler db current
      tinkergym scheduler db upgrade --db postgresql://tinkergym@127.0.0.1:5432/tinkergym
    """


@db_group.command("upgrade")
@db_option
@data_dir_option
def db_upgrade(db: str | None, data_dir: Path) -> None:
    """Create the schema, or upgrade it to this version's (`serve` does this too at start).

    \b
    Example:
      tinkergym scheduler db upgrade --db sqlite:///scheduler-data/scheduler.db
    """
    from tinkergym.scheduler.db import current_revision

    engine = open_database(db, data_dir, migrate=False)
    try:
        before = current_revision(engine)
        engine.dispose()
        engine = open_database(db, data_dir)
        after = current_revision(engine)
    finally:
        engine.dispose()
    if before == after:
        click.echo(f"database is at revision {after} (the newest): nothing to do")
    else:
        click.echo(f"database upgraded: {before or 'empty'} -> {after}")


@db_group.command("current")
@db_option
@data_dir_option
def db_current(db: str | None, data_dir: Path) -> None:
    """Show the database's schema revision and whether it is this version's newest.

    \b
    Example:
      tinkergym scheduler db current
    """
    from alembic.script import ScriptDirectory

    from tinkergym.scheduler.db import alembic_config, current_revision

    engine = open_database(db, data_dir, migrate=False)
    try:
        revision = current_revision(engine)
        head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    finally:
        engine.dispose()
    if revision is None:
        click.echo(f"empty database (no schema); the newest revision is {head}: run tinkergym scheduler db upgrade")
    elif revision == head:
        click.echo(f"{revision} (newest)")
    else:
        click.echo(f"{revision}; the newest is {head}: run tinkergym scheduler db upgrade")
