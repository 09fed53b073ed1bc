"""tenants: a quota on snapshot bytes over all their jobs; snapshots.tenant

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 19:40:00

A snapshot row keeps the tenant its job had at capture, as a sandbox row does: a job moved
to another team later does not move the bytes its snapshots hold.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("snapshot_bytes", sa.BigInteger(), nullable=True))
    op.add_column("snapshots", sa.Column("tenant", sa.String(63), nullable=True))
    op.execute("UPDATE snapshots s SET tenant = j.tenant FROM jobs j WHERE j.name = s.job")
    op.create_index("ix_snapshots_tenant_state", "snapshots", ["tenant", "state"])


def downgrade() -> None:
    op.drop_index("ix_snapshots_tenant_state", table_name="snapshots")
    op.drop_column("snapshots", "tenant")
    op.drop_column("tenants", "snapshot_bytes")
