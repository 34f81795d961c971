"""Alembic migrations of the store (run from code by ``storage.db.migrate``)."""
