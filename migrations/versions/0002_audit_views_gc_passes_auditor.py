"""audit: gc_passes (append-only), the audit schema's views, the sandman_auditor role

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05 16:30:00.000000

The auditors' SQL surface (docs/audit-sql.md). Views in their own schema ``audit`` are
the stable interface: columns are only ever added at the end, never renamed or dropped
without a new major version. They run with their owner's rights, so ``sandman_auditor``
reads them without any privilege on the tables behind them, and it is granted nothing
else: no ledger table (``sandboxes`` holds token hashes and the request ids that
return a sandbox's token to a repeated acquire), no free-form ``detail`` JSON, no writes.

Roles belong to the whole PostgreSQL server, not to one database: the role is created
once (NOLOGIN) and each migrated database grants it its own views. The downgrade drops
the role only when no other database still grants it anything.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REFUSE_CHANGE = """
CREATE FUNCTION sandman_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$
"""

_CREATE_ROLE = """
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'sandman_auditor') THEN
        BEGIN
            CREATE ROLE sandman_auditor NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;  -- a concurrent migration
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'cannot create role sandman_auditor'
                    USING HINT = 'a superuser: CREATE ROLE sandman_auditor NOLOGIN';
        END;
    END IF;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO sandman_auditor', current_database());
END
$$
"""

# Transition and event columns an auditor may read: the free-form ``detail`` JSON is not
# one of them (it is whatever a code path chose to put there), only named keys of it.
_VIEWS = {
    "sandboxes": """
SELECT s.id AS sandbox_id, s.pod_name, s.namespace, s.nonce, s.installation, s.backend,
       s.job, s.owner, s.role, s.image, s.image_digest, s.cpu_m, s.memory_b, s.state,
       s.node_name, s.reuse_count,
       s.requested_at AS owned_from, s.deleted_at AS owned_until,
       s.requested_at, s.creating_at, s.ready_at, s.acquired_at, s.releasing_at,
       s.deleted_at, s.failed_at, s.abandoned_at,
       created.actor AS created_by,
       released.actor AS release_requested_by, released.reason AS release_reason,
       deleted.actor AS deleted_by
FROM public.sandboxes s
LEFT JOIN LATERAL (
    SELECT e.actor FROM public.events e
    WHERE e.sandbox_id = s.id AND e.kind = 'transition' AND e.action = 'intent'
    ORDER BY e.id LIMIT 1
) created ON true
LEFT JOIN LATERAL (
    SELECT e.actor, e.detail ->> 'reason' AS reason FROM public.events e
    WHERE e.sandbox_id = s.id AND e.kind = 'transition' AND e.to_state = 'releasing'
    ORDER BY e.id DESC LIMIT 1
) released ON true
LEFT JOIN LATERAL (
    SELECT e.actor FROM public.events e
    WHERE e.sandbox_id = s.id AND e.kind = 'transition' AND e.to_state = 'deleted'
    ORDER BY e.id DESC LIMIT 1
) deleted ON true
""",
    "state_history": """
SELECT e.id AS event_id, e.sandbox_id, e.pod_name, e.nonce, e.job,
       e.from_state, e.to_state, e.at AS entered_at,
       (SELECT n.at FROM public.events n
        WHERE n.sandbox_id = e.sandbox_id AND n.kind = 'transition' AND n.id > e.id
        ORDER BY n.id LIMIT 1) AS left_at,
       e.actor, e.outcome, e.detail ->> 'reason' AS reason
FROM public.events e
WHERE e.kind = 'transition' AND e.sandbox_id IS NOT NULL
""",
    "events": """
SELECT e.id AS event_id, e.at, e.sandbox_id, e.job, e.pod_name, e.nonce, e.kind, e.action,
       e.from_state, e.to_state, e.outcome, e.actor,
       e.detail ->> 'reason' AS reason, e.detail ->> 'owner' AS owner
FROM public.events e
""",
    # A trainer's hold: from the intent it asked for (or a warm hand-out) until the
    # sandbox went back to its pool, was released, abandoned, failed or deleted.
    "holds": """
SELECT e.sandbox_id, e.pod_name, e.nonce, e.job, e.detail ->> 'owner' AS owner,
       e.at AS held_from,
       (SELECT n.at FROM public.events n
        WHERE n.sandbox_id = e.sandbox_id AND n.id > e.id
          AND ((n.kind = 'reuse' AND n.action = 'accept')
               OR (n.kind = 'transition'
                   AND n.to_state IN ('releasing', 'abandoned', 'failed', 'deleted')))
        ORDER BY n.id LIMIT 1) AS held_until
FROM public.events e
WHERE ((e.kind = 'transition' AND e.action = 'intent')
       OR (e.kind = 'pool' AND e.action = 'hand-out'))
  AND e.detail ->> 'owner' IS NOT NULL
""",
    "leaks": """
SELECT l.id AS leak_id, l.kind, l.namespace, l.pod_name, l.sandbox_id, l.nonce, l.job,
       l.detected_at, l.resolved_at, l.resolution, l.resolved_by,
       l.resolved_at IS NULL AS is_open,
       coalesce(l.resolved_at, now()) - l.detected_at AS open_for,
       l.detail ->> 'reason' AS reason
FROM public.leaks l
""",
    "open_leaks": "SELECT * FROM audit.leaks WHERE is_open",
    # Pods that ran without a live ledger row: no row at all (unowned_pod), or a row that
    # was already closed (late_pod: unowned from the row's deletion at the earliest). An
    # unowned pod's start is known only between two GC passes of its installation (the
    # pod's label): after the last earlier real pass began, before the detecting one.
    "unowned_pods": """
SELECT u.id AS leak_id, u.kind, u.namespace, u.pod_name, u.nonce, u.job, u.sandbox_id,
       u.earliest AS unowned_from_earliest, u.detected_at AS unowned_from_latest,
       u.resolved_at AS unowned_until, u.resolved_at IS NULL AS is_open,
       coalesce(u.resolved_at, now()) - u.detected_at AS min_duration,
       coalesce(u.resolved_at, now()) - u.earliest AS max_duration
FROM (
    SELECT l.id, l.kind, l.namespace, l.pod_name, l.nonce, l.job, l.sandbox_id,
           l.detected_at, l.resolved_at,
           CASE WHEN l.kind = 'late_pod' THEN s.deleted_at
                ELSE (SELECT max(g.started_at) FROM public.gc_passes g
                      WHERE NOT g.dry_run AND g.finished_at < l.detected_at
                        AND g.namespace IS NOT DISTINCT FROM l.namespace
                        AND g.installation
                            = l.detail -> 'labels' ->> 'sandman.io/installation')
           END AS earliest
    FROM public.leaks l LEFT JOIN public.sandboxes s ON s.id = l.sandbox_id
    WHERE l.kind IN ('unowned_pod', 'late_pod')
) u
""",
    "gc_passes": """
SELECT g.id AS pass_id, g.started_at, g.finished_at, g.finished_at - g.started_at AS duration,
       g.installation, g.namespace, g.actor, g.dry_run,
       g.pods_seen, g.foreign_pods, g.pods_seen - g.foreign_pods AS pods_ours, g.live_rows,
       g.pods_seen - g.foreign_pods - g.live_rows AS observed_minus_ledger,
       g.unowned_pods, g.late_pods, g.dangling_rows, g.actions, g.errors,
       (g.unowned_pods = 0 AND g.late_pods = 0 AND g.dangling_rows = 0 AND g.errors = 0)
           AS clean
FROM public.gc_passes g
""",
    # A pod may exist from its create call (creating_at) until its confirmed deletion; a
    # row that failed for good without a delete ended at its failure.
    "pod_usage": """
SELECT u.sandbox_id, u.pod_name, u.job, u.owner, u.role, u.cpu_m, u.memory_b,
       u.pod_from, u.pod_until,
       coalesce(extract(epoch FROM coalesce(u.pod_until, now()) - u.pod_from) / 3600.0, 0)
           AS pod_hours
FROM (
    SELECT s.id AS sandbox_id, s.pod_name, s.job, s.owner, s.role, s.cpu_m, s.memory_b,
           s.creating_at AS pod_from,
           CASE WHEN s.creating_at IS NOT NULL
                THEN coalesce(s.deleted_at, CASE WHEN s.state = 'failed' THEN s.failed_at END)
           END AS pod_until
    FROM public.sandboxes s
) u
""",
    "pod_hours_by_job": """
SELECT p.job, count(*) AS sandboxes, count(p.pod_from) AS pods,
       sum(p.pod_hours) AS pod_hours,
       sum(p.pod_hours * p.cpu_m / 1000.0) AS cpu_core_hours,
       sum(p.pod_hours * p.memory_b / 1073741824.0) AS memory_gib_hours
FROM audit.pod_usage p
GROUP BY p.job
""",
}


def upgrade() -> None:
    op.create_table(
        "gc_passes",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("installation", sa.String(length=63), nullable=False),
        sa.Column("namespace", sa.String(length=63), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("dry_run", sa.Boolean(), nullable=False),
        sa.Column("pods_seen", sa.Integer(), nullable=False),
        sa.Column("foreign_pods", sa.Integer(), nullable=False),
        sa.Column("live_rows", sa.Integer(), nullable=False),
        sa.Column("unowned_pods", sa.Integer(), nullable=False),
        sa.Column("late_pods", sa.Integer(), nullable=False),
        sa.Column("dangling_rows", sa.Integer(), nullable=False),
        sa.Column("actions", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gc_passes")),
    )
    op.create_index("ix_gc_passes_started_at", "gc_passes", ["started_at"], unique=False)
    op.execute(_REFUSE_CHANGE)
    op.execute(
        "CREATE TRIGGER gc_passes_append_only BEFORE UPDATE OR DELETE ON gc_passes "
        "FOR EACH ROW EXECUTE FUNCTION sandman_refuse_change()"
    )
    op.execute(
        "CREATE TRIGGER gc_passes_no_truncate BEFORE TRUNCATE ON gc_passes "
        "FOR EACH STATEMENT EXECUTE FUNCTION sandman_refuse_change()"
    )
    op.execute("CREATE SCHEMA audit")
    for name, body in _VIEWS.items():
        op.execute(f"CREATE VIEW audit.{name} AS {body}")
    op.execute(_CREATE_ROLE)
    # Defence in depth; the role holds no write privilege anyway. Per role, so server-wide;
    # a migrating user who may not alter the role (a superuser created it) skips it.
    op.execute(
        """
DO $$
BEGIN
    ALTER ROLE sandman_auditor SET default_transaction_read_only = on;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'sandman_auditor: default_transaction_read_only left to a superuser';
END
$$
"""
    )
    op.execute("GRANT USAGE ON SCHEMA audit TO sandman_auditor")
    op.execute("GRANT SELECT ON ALL TABLES IN SCHEMA audit TO sandman_auditor")


def downgrade() -> None:
    op.execute("DROP SCHEMA audit CASCADE")
    op.drop_index("ix_gc_passes_started_at", table_name="gc_passes")
    op.drop_table("gc_passes")  # its triggers go with it
    op.execute("DROP FUNCTION sandman_refuse_change()")
    op.execute(
        """
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'sandman_auditor') THEN
        EXECUTE format('REVOKE ALL ON DATABASE %I FROM sandman_auditor', current_database());
        BEGIN
            DROP ROLE sandman_auditor;
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'sandman_auditor kept: another database still grants it privileges';
        END;
    END IF;
END
$$
"""
    )
