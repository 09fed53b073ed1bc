"""snapshots: one row per workspace snapshot; jobs: a quota on snapshot bytes

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("snapshot_bytes", sa.BigInteger(), nullable=True))
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("job", sa.String(63), sa.ForeignKey("jobs.name"), nullable=False),
        sa.Column("installation", sa.String(63), nullable=False),
        sa.Column("sandbox_id", sa.String(32), nullable=True),
        sa.Column("image", sa.String(512), nullable=False),
        sa.Column("image_digest", sa.String(128), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("size_b", sa.BigInteger(), nullable=False),
        sa.Column("stored_b", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
    )
    op.create_index("ix_snapshots_job", "snapshots", ["job"])
    op.create_index("ix_snapshots_job_state", "snapshots", ["job", "state"])
    op.create_index("ix_snapshots_expires_at", "snapshots", ["expires_at"])


def downgrade() -> None:
    op.drop_table("snapshots")
    op.drop_column("jobs", "snapshot_bytes")
