"""Alembic environment for the store. Run from code only (``storage.db.migrate``), with the
connection passed in ``config.attributes["connection"]``; there is no alembic.ini."""

from __future__ import annotations

from alembic import context

from storage.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run the store's migrations through storage.db.migrate(), not the CLI")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
