"""Alembic environment: the engine comes from the caller (:func:`tinkergym.scheduler.db.upgrade`), not from an ini file."""

from __future__ import annotations

from alembic import context

from tinkergym.scheduler.db import make_engine, metadata

config = context.config
engine = config.attributes.get("engine")
if engine is None:  # the alembic command line: `alembic -x url=sqlite:///scheduler.db upgrade head`
    engine = make_engine(context.get_x_argument(as_dictionary=True)["url"])

with engine.connect() as connection:
    # render_as_batch: SQLite alters tables by copying them, which Alembic's batch mode does for it.
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
