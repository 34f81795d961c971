"""chunkscope storage: the telemetry collector (``python -m storage``) and the store it writes.

Engines stream events over websockets (docs/telemetry.md); one writer thread stores them in
SQLite (WAL) or PostgreSQL through SQLAlchemy Core (``storage.schema``, Alembic migrations in
``storage/migrations``); ``storage.queries`` reads them back as pandas DataFrames for the
dashboard. Importing this package is cheap and never imports torch.
"""
