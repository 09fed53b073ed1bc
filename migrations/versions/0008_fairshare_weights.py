"""fair share: a weight per tenant and per job; weight changes in audit.quota_changes

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 19:40:00

The fair acquire queue (broker/acquire/fairshare.py) splits the cluster's create rate by
these weights (the admin UI shows each job's share, by ``creating_at``: indexed here); they
change at run time and every change is an ``admin`` event, listed with the quota changes
(same columns: the view keeps its stable surface).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_QUOTA_CHANGES = """
SELECT e.id AS event_id, e.at, e.actor, e.action, e.detail ->> 'tenant' AS tenant, e.job,
       e.detail -> 'before' AS before, e.detail -> 'after' AS after
FROM public.events e
WHERE e.kind = 'admin' AND e.action IN ({actions})
"""
_BEFORE = "'tenant-create', 'tenant-set', 'job-tenant'"
_AFTER = _BEFORE + ", 'job-weight'"


def upgrade() -> None:
    for table in ("tenants", "jobs"):
        op.add_column(
            table, sa.Column("weight", sa.Float(), nullable=False, server_default=sa.text("1"))
        )
    op.create_index("ix_sandboxes_creating_at", "sandboxes", ["creating_at"])
    op.execute(
        f"CREATE OR REPLACE VIEW audit.quota_changes AS {_QUOTA_CHANGES.format(actions=_AFTER)}"
    )


def downgrade() -> None:
    op.execute(
        f"CREATE OR REPLACE VIEW audit.quota_changes AS {_QUOTA_CHANGES.format(actions=_BEFORE)}"
    )
    op.drop_index("ix_sandboxes_creating_at", table_name="sandboxes")
    for table in ("jobs", "tenants"):
        op.drop_column(table, "weight")
