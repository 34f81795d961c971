"""The long-prefill cap in force at each step: ``steps.long_prefill_token_threshold`` (NULL for
steps stored before the cap existed, or sent by an engine that has none).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("long_prefill_token_threshold", sa.Integer()))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("long_prefill_token_threshold")
