"""The ownership audit: cluster vs ledger, per job, with leaks found and still open.

``sandman audit`` is a read-only GC pass plus counts; it exits non-zero when a pod of ours
has no row (unowned), runs although its row is closed (late), or a live row has no pod
(dangling), which is what an operator or a CI job gates on. On the local backend "pods"
are the sandbox processes the kernel shows (``broker.backends.localprocs``), so the audit
compares the ledger with what really runs there too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from sqlalchemy import func, select

from broker import names
from broker.ledger.models import Leak, Sandbox
from broker.ledger.states import LIVE_STATES
from broker.ownership.gc import GcReport, run_gc
from broker.ownership.provider import Provider
from broker.snapshots.collect import audit as snapshot_audit
from broker.snapshots.store import open_store


@dataclass
class AuditReport:
    gc: GcReport
    pods_by_job: dict[str, int] = field(default_factory=dict)
    live_rows_by_job: dict[str, dict[str, int]] = field(default_factory=dict)
    leaks_total: int = 0
    leaks_open: dict[str, int] = field(default_factory=dict)
    # broker.snapshots.collect.audit: rows without blobs, blobs and manifests without rows
    snapshots: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.gc.unowned_pods
            and not self.gc.late_pods
            and not self.gc.dangling_rows
            and not self.snapshots.get("rows_without_blobs")
        )

    def to_dict(self) -> dict[str, object]:
        """The report as JSON: its own counts (every field but ``gc``) and the GC's findings."""
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gc"}
        return {
            "ok": self.ok,
            **counts,
            "unowned_pods": self.gc.unowned_pods,
            "late_pods": self.gc.late_pods,
            "foreign_pods": self.gc.foreign_pods,
            "dangling_rows": self.gc.dangling_rows,
            "pending_actions": self.gc.actions,
        }


def run_audit(provider: Provider) -> AuditReport:
    gc = run_gc(provider, dry_run=True)
    report = AuditReport(gc=gc)
    pods = provider.backend.list_installation(
        provider.settings.namespace, provider.settings.installation_id
    )
    report.pods_by_job = dict(Counter(p.labels.get(names.LABEL_JOB, "?") for p in pods))
    with provider.sessions() as session:
        for job, state, count in session.execute(
            select(Sandbox.job, Sandbox.state, func.count())
            .where(Sandbox.state.in_([s.value for s in LIVE_STATES]))
            .group_by(Sandbox.job, Sandbox.state)
        ):
            report.live_rows_by_job.setdefault(job, {})[str(state)] = int(count)
        report.leaks_total = int(session.scalar(select(func.count()).select_from(Leak)) or 0)
        for kind, count in session.execute(
            select(Leak.kind, func.count()).where(Leak.resolved_at.is_(None)).group_by(Leak.kind)
        ):
            report.leaks_open[kind] = int(count)
    report.snapshots = snapshot_audit(
        provider.sessions,
        open_store(provider.settings),
        installation=provider.settings.installation_id,
    )
    return report


def format_audit(report: AuditReport) -> str:
    lines = ["ownership audit", "==============="]
    jobs = sorted(set(report.pods_by_job) | set(report.live_rows_by_job))
    lines.append(f"{'job':24} {'pods':>6} {'live rows':>10}  states")
    for job in jobs:
        states = report.live_rows_by_job.get(job, {})
        states_text = ", ".join(f"{k}={v}" for k, v in sorted(states.items()))
        lines.append(
            f"{job:24} {report.pods_by_job.get(job, 0):>6} "
            f"{sum(states.values()):>10}  {states_text}"
        )
    lines.append(f"unowned pods (ours by label, no ledger row): {len(report.gc.unowned_pods)}")
    lines.extend(f"  - {name}" for name in report.gc.unowned_pods)
    lines.append(f"late pods (running, row already closed):     {len(report.gc.late_pods)}")
    lines.extend(f"  - {name}" for name in report.gc.late_pods)
    lines.append(f"dangling rows (live row, no pod):            {len(report.gc.dangling_rows)}")
    lines.extend(f"  - {sid}" for sid in report.gc.dangling_rows)
    lines.append(f"foreign pods (other installations, untouched): {len(report.gc.foreign_pods)}")
    lines.append(f"GC actions pending: {len(report.gc.actions)}")
    lines.append(f"leaks recorded: {report.leaks_total}; open: {report.leaks_open or 0}")
    snaps = report.snapshots
    lines.append(f"snapshots (ready rows): {snaps.get('snapshot_rows', 0)}")
    for key, text in (
        ("rows_without_blobs", "snapshot rows without blobs:  "),
        ("blobs_without_rows", "blobs without snapshot rows: "),
        ("manifests_without_rows", "manifests without rows:      "),
    ):
        lines.append(f"{text}{len(snaps.get(key, []))}")
        lines.extend(f"  - {item}" for item in snaps.get(key, [])[:20])
    lines.append(
        "OK"
        if report.ok
        else "NOT OK: unowned or late pods, dangling rows, or snapshot rows without blobs"
    )
    return "\n".join(lines)
