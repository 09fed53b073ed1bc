"""tenants: quotas per team, jobs.tenant, sandboxes.tenant, tenant columns in the audit views

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05 16:40:00.000000

A sandbox row keeps the tenant its job had when the intent was admitted: a job moved to
another team later does not rewrite who used what. The audit views gain ``tenant`` as
their last column (the stable-surface rule of 0002), plus ``pod_hours_by_tenant`` and
``quota_changes`` (every quota change and job move, from the admin events).
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _revision_0002() -> ModuleType:
    """0002's view texts, which the downgrade restores (one definition, not a copy)."""
    path = Path(__file__).with_name("0002_audit_views_gc_passes_auditor.py")
    spec = importlib.util.spec_from_file_location("sandman_migration_0002", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SANDBOXES_TAIL = ",\n       s.tenant\nFROM public.sandboxes s\nLEFT JOIN LATERAL ("

_NEW_VIEWS = {
    "pod_hours_by_tenant": """
SELECT p.tenant, count(DISTINCT p.job) AS jobs, count(*) AS sandboxes,
       count(p.pod_from) AS pods, sum(p.pod_hours) AS pod_hours,
       sum(p.pod_hours * p.cpu_m / 1000.0) AS cpu_core_hours,
       sum(p.pod_hours * p.memory_b / 1073741824.0) AS memory_gib_hours
FROM audit.pod_usage p
GROUP BY p.tenant
""",
    # Quota changes and job moves: their before and after hold quota numbers and tenant
    # names only (broker.acquire.quotas writes them), nothing else of the event's detail.
    "quota_changes": """
SELECT e.id AS event_id, e.at, e.actor, e.action, e.detail ->> 'tenant' AS tenant, e.job,
       e.detail -> 'before' AS before, e.detail -> 'after' AS after
FROM public.events e
WHERE e.kind = 'admin' AND e.action IN ('tenant-create', 'tenant-set', 'job-tenant')
""",
}


def _with_tenant(views: dict[str, str]) -> dict[str, str]:
    """0002's ``sandboxes`` and ``pod_usage`` with ``tenant`` appended as last column."""
    sandboxes = views["sandboxes"].replace(
        "\nFROM public.sandboxes s\nLEFT JOIN LATERAL (", _SANDBOXES_TAIL, 1
    )
    usage = (
        views["pod_usage"]
        .replace("AS pod_hours\nFROM (", "AS pod_hours,\n       u.tenant\nFROM (", 1)
        .replace(
            "s.memory_b,\n           s.creating_at",
            "s.memory_b, s.tenant,\n           s.creating_at",
            1,
        )
    )
    assert sandboxes != views["sandboxes"] and usage.count("tenant") == 2
    return {"sandboxes": sandboxes, "pod_usage": usage}


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("max_live", sa.Integer(), nullable=True),
        sa.Column("creates_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )
    op.add_column("jobs", sa.Column("tenant", sa.String(length=63), nullable=True))
    op.create_index(op.f("ix_jobs_tenant"), "jobs", ["tenant"], unique=False)
    op.create_foreign_key(op.f("fk_jobs_tenant_tenants"), "jobs", "tenants", ["tenant"], ["name"])
    op.add_column("sandboxes", sa.Column("tenant", sa.String(length=63), nullable=True))
    op.create_index(
        "ix_sandboxes_tenant_requested", "sandboxes", ["tenant", "requested_at"], unique=False
    )
    op.create_index("ix_sandboxes_tenant_state", "sandboxes", ["tenant", "state"], unique=False)
    for name, body in _with_tenant(_revision_0002()._VIEWS).items():
        op.execute(f"CREATE OR REPLACE VIEW audit.{name} AS {body}")
    for name, body in _NEW_VIEWS.items():
        op.execute(f"CREATE VIEW audit.{name} AS {body}")
        op.execute(f"GRANT SELECT ON audit.{name} TO sandman_auditor")


def downgrade() -> None:
    for name in _NEW_VIEWS:
        op.execute(f"DROP VIEW audit.{name}")
    # A view cannot lose a column in place: drop the two (and the one built on pod_usage)
    # and create them as 0002 did.
    views = _revision_0002()._VIEWS
    op.execute("DROP VIEW audit.pod_hours_by_job, audit.pod_usage, audit.sandboxes")
    for name in ("sandboxes", "pod_usage", "pod_hours_by_job"):
        op.execute(f"CREATE VIEW audit.{name} AS {views[name]}")
        op.execute(f"GRANT SELECT ON audit.{name} TO sandman_auditor")
    op.drop_index("ix_sandboxes_tenant_state", table_name="sandboxes")
    op.drop_index("ix_sandboxes_tenant_requested", table_name="sandboxes")
    op.drop_column("sandboxes", "tenant")
    op.drop_constraint(op.f("fk_jobs_tenant_tenants"), "jobs", type_="foreignkey")
    op.drop_index(op.f("ix_jobs_tenant"), table_name="jobs")
    op.drop_column("jobs", "tenant")
    op.drop_table("tenants")
