"""sandboxes: the digest each pod runs, whether its start pulled; jobs: hot images

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("image_resolved", sa.String(128), nullable=True))
    op.add_column("sandboxes", sa.Column("image_pulled", sa.Boolean(), nullable=True))
    op.add_column("jobs", sa.Column("hot_images", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "hot_images")
    op.drop_column("sandboxes", "image_pulled")
    op.drop_column("sandboxes", "image_resolved")
