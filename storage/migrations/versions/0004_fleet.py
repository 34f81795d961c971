"""The fleet: ``fleet_collectors`` (each collector's address and heartbeat), ``fleet_engines``
(which collector holds each engine's connection) and ``fleet_controls`` (a control handed to
that collector, and the engine's answer), for several collectors on one PostgreSQL store.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_collectors",
        sa.Column("collector_id", sa.Text(), primary_key=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("host", sa.Text()),
        sa.Column("pid", sa.Integer()),
        sa.Column("started", sa.Float(), nullable=False),
        sa.Column("heartbeat", sa.Float(), nullable=False),
    )
    op.create_table(
        "fleet_engines",
        sa.Column("engine_id", sa.Text(), primary_key=True),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("collector_id", sa.Text(), nullable=False),
        sa.Column("connected", sa.Boolean(), nullable=False),
        sa.Column("info", sa.Text(), nullable=False),
        sa.Column("metrics_url", sa.Text()),
        sa.Column("updated", sa.Float(), nullable=False),
    )
    op.create_table(
        "fleet_controls",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("collector_id", sa.Text(), nullable=False),
        sa.Column("engine_id", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("claimed", sa.Float()),
        sa.Column("answer", sa.Text()),
        sa.Column("answered", sa.Float()),
    )
    op.create_index("ix_fleet_controls_collector", "fleet_controls", ["collector_id", "claimed"])


def downgrade() -> None:
    op.drop_index("ix_fleet_controls_collector", table_name="fleet_controls")
    op.drop_table("fleet_controls")
    op.drop_table("fleet_engines")
    op.drop_table("fleet_collectors")
