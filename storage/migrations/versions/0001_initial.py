"""The initial store: engines, runs, steps (packed chunks and tokens), requests, request events,
controls, gaps.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engines",
        sa.Column("engine_id", sa.Text(), primary_key=True),
        sa.Column("host", sa.Text()),
        sa.Column("model", sa.Text()),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("engine_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text()),
        sa.Column("host", sa.Text()),
        sa.Column("pid", sa.Integer()),
        sa.Column("policy", sa.Text()),
        sa.Column("token_budget", sa.Integer()),
        sa.Column("max_token_budget", sa.Integer()),
        sa.Column("kv_blocks_total", sa.Integer()),
        sa.Column("block_size", sa.Integer()),
        sa.Column("config", sa.Text()),
        sa.Column("hello", sa.Text()),
        sa.Column("clock_wall_ns", sa.BigInteger(), nullable=False),
        sa.Column("clock_mono_ns", sa.BigInteger(), nullable=False),
        sa.Column("started", sa.Float(), nullable=False),
        sa.Column("ended", sa.Float()),
        sa.Column("ended_without_goodbye", sa.Boolean(), nullable=False),
        sa.Column("connected", sa.Boolean(), nullable=False),
        sa.Column("last_seen", sa.Float()),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger()),
        sa.Column("last_step_end_ns", sa.BigInteger()),
        sa.Column("num_steps", sa.BigInteger(), nullable=False),
        sa.Column("num_events", sa.BigInteger(), nullable=False),
        sa.Column("num_gap_events", sa.Integer(), nullable=False),
        sa.Column("next_req_no", sa.Integer(), nullable=False),
        sa.UniqueConstraint("engine_id", "run_id", name="uq_runs_engine_run"),
    )
    op.create_table(
        "steps",
        sa.Column("run_key", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("forward_ns", sa.BigInteger()),
        sa.Column("token_budget", sa.Integer()),
        sa.Column("policy", sa.Text()),
        sa.Column("num_decode_tokens", sa.Integer()),
        sa.Column("num_prefill_tokens", sa.Integer()),
        sa.Column("num_scheduled_tokens", sa.Integer()),
        sa.Column("num_running", sa.Integer()),
        sa.Column("num_waiting", sa.Integer()),
        sa.Column("kv_blocks_used", sa.Integer()),
        sa.Column("kv_blocks_total", sa.Integer()),
        sa.Column("num_preemptions", sa.Integer()),
        sa.Column("num_chunks", sa.Integer(), nullable=False),
        sa.Column("num_tokens_out", sa.Integer(), nullable=False),
        sa.Column("chunks", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("run_key", "seq", name="pk_steps"),
    )
    op.create_index("ix_steps_run_step", "steps", ["run_key", "step"])
    op.create_index("ix_steps_run_start", "steps", ["run_key", "start_ns"])
    op.create_table(
        "requests",
        sa.Column("run_key", sa.Integer(), nullable=False),
        sa.Column("req_no", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("traffic_class", sa.Text()),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_image_tokens", sa.Integer(), nullable=False),
        sa.Column("num_cached_tokens", sa.Integer(), nullable=False),
        sa.Column("num_output_tokens", sa.Integer(), nullable=False),
        sa.Column("num_preemptions", sa.Integer(), nullable=False),
        sa.Column("arrival_ns", sa.BigInteger()),
        sa.Column("first_scheduled_ns", sa.BigInteger()),
        sa.Column("finished_ns", sa.BigInteger()),
        sa.Column("finish_reason", sa.Text()),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("first_token_ns", sa.BigInteger()),
        sa.Column("last_token_ns", sa.BigInteger()),
        sa.Column("first_token_step", sa.BigInteger()),
        sa.Column("last_token_step", sa.BigInteger()),
        sa.Column("max_itl_ns", sa.BigInteger()),
        sa.PrimaryKeyConstraint("run_key", "req_no", name="pk_requests"),
        sa.UniqueConstraint("run_key", "request_id", name="uq_requests_run_request"),
    )
    op.create_index("ix_requests_run_arrival", "requests", ["run_key", "arrival_ns"])
    op.create_table(
        "request_events",
        sa.Column("run_key", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("time_ns", sa.BigInteger()),
        sa.Column("step", sa.BigInteger()),
        sa.Column("traffic_class", sa.Text()),
        sa.Column("num_output_tokens", sa.Integer()),
        sa.Column("finish_reason", sa.Text()),
        sa.PrimaryKeyConstraint("run_key", "seq", name="pk_request_events"),
    )
    op.create_index("ix_request_events_run_request", "request_events", ["run_key", "request_id"])
    op.create_table(
        "controls",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("engine_id", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Text()),
        sa.Column("seq", sa.BigInteger()),
        sa.Column("time_ns", sa.BigInteger()),
        sa.Column("wall", sa.Float(), nullable=False),
        sa.Column("key", sa.Text()),
        sa.Column("old_value", sa.Text()),
        sa.Column("new_value", sa.Text()),
        sa.Column("accepted", sa.Boolean(), nullable=False),
        sa.Column("source", sa.Text()),
        sa.Column("applied_at_step", sa.BigInteger()),
        sa.Column("reason", sa.Text()),
        sa.Column("request_id", sa.Text()),
        sa.UniqueConstraint("engine_id", "run_id", "seq", name="uq_controls_engine_run_seq"),
    )
    op.create_index("ix_controls_engine_wall", "controls", ["engine_id", "wall"])
    op.create_table(
        "gaps",
        sa.Column("run_key", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("first_seq_lost", sa.BigInteger()),
        sa.Column("last_seq_lost", sa.BigInteger()),
        sa.Column("num_events_lost", sa.BigInteger()),
        sa.Column("reason", sa.Text()),
        sa.Column("time_ns", sa.BigInteger()),
        sa.Column("wall", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("run_key", "seq", name="pk_gaps"),
    )


def downgrade() -> None:
    for table in ("gaps", "controls", "request_events", "requests", "steps", "runs", "engines"):
        op.drop_table(table)
