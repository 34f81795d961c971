"""The run secret's hash: ``runs.secret_sha256`` (SHA-256 of the ``run_secret`` the run's first
hello presented; NULL for runs of engines that send none). A later hello of the run must present
the same secret.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("secret_sha256", sa.Text()))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("secret_sha256")
