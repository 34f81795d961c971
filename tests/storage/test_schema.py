"""Migrating an empty store gives exactly the expected tables and columns; migrating again is a
no-op; the Alembic revisions and ``storage.schema`` agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from storage import db as dbm
from storage.schema import metadata

EXPECTED = {
    "engines": ["engine_id", "host", "model", "first_seen", "last_seen"],
    "runs": [
        "id",
        "engine_id",
        "run_id",
        "model",
        "host",
        "pid",
        "policy",
        "token_budget",
        "max_token_budget",
        "kv_blocks_total",
        "block_size",
        "config",
        "hello",
        "clock_wall_ns",
        "clock_mono_ns",
        "started",
        "ended",
        "ended_without_goodbye",
        "connected",
        "last_seen",
        "last_seq",
        "last_step",
        "last_step_end_ns",
        "num_steps",
        "num_events",
        "num_gap_events",
        "next_req_no",
        "secret_sha256",
    ],
    "steps": [
        "run_key",
        "seq",
        "step",
        "start_ns",
        "end_ns",
        "forward_ns",
        "token_budget",
        "policy",
        "num_decode_tokens",
        "num_prefill_tokens",
        "num_scheduled_tokens",
        "num_running",
        "num_waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "num_preemptions",
        "num_chunks",
        "num_tokens_out",
        "chunks",
        "tokens",
        "long_prefill_token_threshold",
    ],
    "requests": [
        "run_key",
        "req_no",
        "request_id",
        "traffic_class",
        "num_prompt_tokens",
        "num_image_tokens",
        "num_cached_tokens",
        "num_output_tokens",
        "num_preemptions",
        "arrival_ns",
        "first_scheduled_ns",
        "finished_ns",
        "finish_reason",
        "num_tokens",
        "first_token_ns",
        "last_token_ns",
        "first_token_step",
        "last_token_step",
        "max_itl_ns",
    ],
    "request_events": [
        "run_key",
        "seq",
        "request_id",
        "kind",
        "time_ns",
        "step",
        "traffic_class",
        "num_output_tokens",
        "finish_reason",
    ],
    "controls": [
        "id",
        "engine_id",
        "run_id",
        "seq",
        "time_ns",
        "wall",
        "key",
        "old_value",
        "new_value",
        "accepted",
        "source",
        "applied_at_step",
        "reason",
        "request_id",
    ],
    "gaps": [
        "run_key",
        "seq",
        "first_seq_lost",
        "last_seq_lost",
        "num_events_lost",
        "reason",
        "time_ns",
        "wall",
    ],
    "fleet_collectors": ["collector_id", "url", "host", "pid", "started", "heartbeat"],
    "fleet_engines": [
        "engine_id",
        "run_id",
        "collector_id",
        "connected",
        "info",
        "metrics_url",
        "updated",
    ],
    "fleet_controls": [
        "id",
        "collector_id",
        "engine_id",
        "message",
        "created",
        "claimed",
        "answer",
        "answered",
    ],
}
PRIMARY_KEYS = {
    "engines": ["engine_id"],
    "runs": ["id"],
    "steps": ["run_key", "seq"],
    "requests": ["run_key", "req_no"],
    "request_events": ["run_key", "seq"],
    "controls": ["id"],
    "gaps": ["run_key", "seq"],
    "fleet_collectors": ["collector_id"],
    "fleet_engines": ["engine_id"],
    "fleet_controls": ["id"],
}
INDEXES = {
    "steps": {
        "ix_steps_run_step": ["run_key", "step"],
        "ix_steps_run_start": ["run_key", "start_ns"],
    },
    "requests": {"ix_requests_run_arrival": ["run_key", "arrival_ns"]},
    "fleet_controls": {"ix_fleet_controls_collector": ["collector_id", "claimed"]},
}


def _layout(url: str) -> dict[str, list[str]]:
    db = dbm.connect(url)
    try:
        insp = inspect(db)
        return {t: [c["name"] for c in insp.get_columns(t)] for t in insp.get_table_names()}
    finally:
        db.dispose()


def test_migrate_empty_store_gives_expected_tables(db_url: str) -> None:
    db = dbm.connect(db_url)
    try:
        dbm.migrate(db)
        assert dbm.current_revision(db) == "0004"
        insp = inspect(db)
        layout = {t: [c["name"] for c in insp.get_columns(t)] for t in insp.get_table_names()}
        assert layout.pop("alembic_version") == ["version_num"]
        assert layout == EXPECTED
        for table, pk in PRIMARY_KEYS.items():
            assert insp.get_pk_constraint(table)["constrained_columns"] == pk, table
        for table, indexes in INDEXES.items():
            found = {i["name"]: i["column_names"] for i in insp.get_indexes(table)}
            for name, columns in indexes.items():
                assert found.get(name) == columns, (table, name, found)
        uniques = {u["name"]: u["column_names"] for u in insp.get_unique_constraints("runs")}
        assert uniques["uq_runs_engine_run"] == ["engine_id", "run_id"]
    finally:
        db.dispose()


def test_migrate_twice_is_a_no_op(db_url: str) -> None:
    db = dbm.connect(db_url)
    try:
        dbm.migrate(db)
        before = _layout(db_url)
        dbm.migrate(db)
        assert _layout(db_url) == before
        assert dbm.current_revision(db) == "0004"
    finally:
        db.dispose()


def test_revisions_match_schema_module(db_url: str) -> None:
    db = dbm.connect(db_url)
    try:
        dbm.migrate(db)
        with db.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == []
    finally:
        db.dispose()


def test_sqlite_connections_use_wal_and_pragmas(sqlite_url: str) -> None:
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    ro = dbm.connect(sqlite_url, readonly=True)
    try:
        with db.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == dbm.BUSY_TIMEOUT_MS
        with ro.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA query_only").scalar() == 1
    finally:
        db.dispose()
        ro.dispose()


def test_readonly_sqlite_creates_nothing(tmp_path: Path) -> None:
    import pytest

    missing = tmp_path / "typo" / "chunkscope.db"
    with pytest.raises(FileNotFoundError, match="no store at"):
        dbm.connect(f"sqlite:///{missing}", readonly=True)
    assert not (tmp_path / "typo").exists()


def test_bad_url_is_a_value_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="not a database URL"):
        dbm.connect("no such url")
    with pytest.raises(ValueError, match="unsupported database"):
        dbm.connect("mysql://localhost/x")


def test_storage_never_imports_torch() -> None:
    code = (
        "import storage, storage.db, storage.schema, storage.store, storage.writer, "
        "storage.collector, storage.queries, testkit.engines, storage.cli, storage.control; "
        "import sys; assert 'torch' not in sys.modules, 'storage imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _store_at_0001_with_a_step(url: str) -> None:
    """A store as revision 0001 wrote it: one run with one step (no cap column)."""
    from alembic import command
    from sqlalchemy import text

    db = dbm.connect(url)
    try:
        cfg = dbm.alembic_config(db)
        with db.begin() as connection:
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "0001")
        with db.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO runs (id, engine_id, run_id, clock_wall_ns, clock_mono_ns, "
                    "started, ended_without_goodbye, connected, last_seq, num_steps, num_events, "
                    "num_gap_events, next_req_no) "
                    "VALUES (1, 'e', 'r', 0, 0, 0, false, false, 1, 1, 1, 0, 0)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO steps (run_key, seq, step, start_ns, end_ns, token_budget, "
                    "num_chunks, num_tokens_out, chunks, tokens) "
                    "VALUES (1, 1, 0, 1000, 2000, 512, 0, 0, :b, :b)"
                ),
                {"b": b""},
            )
    finally:
        db.dispose()


def test_store_written_before_the_cap_reads_and_migrates(db_url: str) -> None:
    from storage import queries

    _store_at_0001_with_a_step(db_url)
    db = dbm.connect(db_url)
    try:
        before = queries.steps(db)  # a reader that never migrates
        assert before["token_budget"].tolist() == [512]
        assert before["long_prefill_token_threshold"].isna().all()
        dbm.migrate(db)
        assert dbm.current_revision(db) == "0004"
        after = queries.steps(db)
        assert after["step"].tolist() == [0]
        assert after["long_prefill_token_threshold"].isna().all()
    finally:
        db.dispose()
