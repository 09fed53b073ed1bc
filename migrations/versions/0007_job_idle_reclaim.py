"""jobs.idle_timeout_s: the idle reclaim of held sandboxes (NULL: off)

Until now the column was only the default idle timeout of a job's warm pools, and every
pool entry written since carries its own (``idle_timeout_s`` in ``warm_pools``); the
default now comes from the settings. The column is reused for the per-job idle reclaim
(broker/acquire/idle.py): nullable, and cleared on upgrade, so no existing job starts
reclaiming held sandboxes without its operator asking for it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 19:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("jobs", "idle_timeout_s", existing_type=sa.Float(), nullable=True)
    op.execute("UPDATE jobs SET idle_timeout_s = NULL")


def downgrade() -> None:
    op.execute("UPDATE jobs SET idle_timeout_s = 300 WHERE idle_timeout_s IS NULL")
    op.alter_column("jobs", "idle_timeout_s", existing_type=sa.Float(), nullable=False)
