"""Alembic environment: the engine comes from the caller (:func:`tinkergym.scheduler.db.upgrade`), not from an ini file."""

from __future__ import annotations

from alembic import context

from tinkergym.scheduler.db import make_engine, metadata

config = context.config
engine = config.attributes.get("engine")
if engine is None:  # the alembic command line: `alembic -x url=sqlite:///scheduler.db upgrade head`
    engine = make_engine(context.get_x_argument(as_dictionary=True)["url"])

with engine.connect() as connection:
    sqlite = connection.dialect.name == "sqlite"
    # SQLite alters a table by copying it and dropping the old one (Alembic's batch mode, render_as_batch). With foreign
    # keys on, that drop fails as soon as other tables' rows point at it, so they are off while migrating (SQLite's own
    # procedure for altering tables) and checked before the commit. Set on the driver's connection: a PRAGMA inside the
    # transaction would be ignored.
    raw = connection.connection.dbapi_connection if sqlite else None
    if raw is not None:
        raw.execute("PRAGMA foreign_keys=OFF")
    try:
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=sqlite)
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration left rows whose foreign keys point nowhere: {broken[:5]}")
    finally:
        if raw is not None:
            raw.execute("PRAGMA foreign_keys=ON")
