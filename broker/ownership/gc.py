"""The garbage collector: compare the pods carrying our labels with the ledger, and settle.

Safety argument. Pods are listed BEFORE rows are read, and every row is committed before
its create call, so any pod of ours that the list shows already has a committed row when
we look. A pod is deleted only when its nonce matches a row of this installation
(``Backend.delete`` re-checks the nonce and the UID). Pods with our label keys but no
matching row, or another installation's value, are reported and never touched.

What one pass settles:
  pod, row deleted/failed       -> delete the pod (late: a create after give-up, a
                                   delete that did not take); the audit reports it
  pod, row releasing            -> retry the pending delete
  pod, row creating, lease over -> stuck create (worker died): release
  pod, row ready, lease over    -> abandoned by its trainer: release
  pod, row ready, warm, idle    -> idle past its pools' timeout: release (held sandboxes
                                   idle past the job's: broker/acquire/idle.py)
  no pod, row ready             -> pod lost: close the row
  no pod, row requested/creating/releasing/abandoned past its lease -> close the row
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from broker import names
from broker.backends.base import PodInfo
from broker.errors import OwnershipError, SandmanError
from broker.ledger import store
from broker.ledger.models import GcPass, Job, Leak, Sandbox, utcnow
from broker.ledger.states import LIVE_STATES, State
from broker.ownership.provider import Provider
from broker.snapshots.collect import collect
from broker.snapshots.store import default_store

GC_LAST_KEY = names.GC_LAST_KEY
log = logging.getLogger(__name__)
GC_LOCK_ID = 0x5A4D_6763  # pg advisory lock: one GC pass at a time, cluster-wide
RECENT_S = 10.0  # rows younger than this may belong to a create racing our list


@dataclass
class GcReport:
    dry_run: bool
    pods_seen: int = 0
    live_rows: int = 0
    actions: list[dict[str, str]] = field(default_factory=list)
    unowned_pods: list[str] = field(default_factory=list)
    # Ours by nonce, but their row is already closed: a sandbox still running after its
    # owner said it was gone (a late create, a delete that did not take). Deleted by nonce.
    late_pods: list[str] = field(default_factory=list)
    foreign_pods: list[str] = field(default_factory=list)
    dangling_rows: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    skipped_locked: bool = False
    # What the pass collected of snapshots (broker.snapshots.collect); empty on a dry run.
    snapshots: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return (
            not self.unowned_pods
            and not self.late_pods
            and not self.dangling_rows
            and not self.errors
        )

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"clean": self.clean}


def summarize(report: GcReport, *, by: str) -> dict[str, object]:
    """The small JSON the admin UI and /metrics show for the latest pass."""
    import datetime as _dt

    return {
        "at": _dt.datetime.now(_dt.UTC).isoformat(),
        "by": by,
        "dry_run": report.dry_run,
        "duration_s": round(report.duration_s, 4),
        "pods_seen": report.pods_seen,
        "live_rows": report.live_rows,
        "actions": len(report.actions),
        "unowned_pods": len(report.unowned_pods),
        "late_pods": len(report.late_pods),
        "foreign_pods": len(report.foreign_pods),
        "errors": len(report.errors),
        "skipped_locked": report.skipped_locked,
    }


@contextmanager
def _gc_lock(session: Session) -> Iterator[bool]:
    if session.bind is None or session.bind.dialect.name != "postgresql":
        yield True
        return
    got = bool(session.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": GC_LOCK_ID}).scalar())
    try:
        yield got
    finally:
        if got:
            session.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": GC_LOCK_ID})


def run_gc(provider: Provider, *, dry_run: bool = False) -> GcReport:
    """One pass. Safe to run from several processes: a second concurrent pass skips."""
    report = GcReport(dry_run=dry_run)
    started, started_at = time.monotonic(), utcnow()
    with provider.sessions() as lock_session, _gc_lock(lock_session) as got:
        if not got:
            report.skipped_locked = True
            return report
        _pass(provider, report)
        if not dry_run:
            _collect_snapshots(provider, report)
        report.duration_s = time.monotonic() - started
        _record_pass(provider, report, started_at)
    return report


def _collect_snapshots(provider: Provider, report: GcReport) -> None:
    """Expired and orphaned snapshots, then blobs no snapshot names (module doc there)."""
    settings = provider.settings
    try:
        done = collect(
            provider.sessions,
            default_store(settings.state_dir),
            installation=settings.installation_id,
            grace_s=settings.snapshot_grace_s,
        )
    except Exception as exc:
        log.exception("snapshot collection failed")
        report.errors.append(f"snapshots: {type(exc).__name__}: {exc}"[:500])
        return
    report.snapshots = done.to_dict()


def _record_pass(provider: Provider, report: GcReport, started_at: dt.datetime) -> None:
    """Append the pass's observed-versus-ledger counts to ``gc_passes`` (append-only in the
    database), still under the GC lock, so the rows of one installation never overlap.
    A dry run is recorded too, marked: it observed as much as a real pass."""
    with provider.sessions.begin() as session:
        session.add(
            GcPass(
                started_at=started_at,
                finished_at=utcnow(),
                installation=provider.settings.installation_id,
                namespace=provider.settings.namespace,
                actor=provider.actor,
                dry_run=report.dry_run,
                pods_seen=report.pods_seen,
                foreign_pods=len(report.foreign_pods),
                live_rows=report.live_rows,
                unowned_pods=len(report.unowned_pods),
                late_pods=len(report.late_pods),
                dangling_rows=len(report.dangling_rows),
                actions=len(report.actions),
                errors=len(report.errors),
            )
        )


def _pass(provider: Provider, report: GcReport) -> None:
    settings = provider.settings
    listed_at = utcnow()
    pods = provider.backend.list_all_labelled(settings.namespace)
    report.pods_seen = len(pods)
    with provider.sessions() as session:
        rows = {
            r.nonce: r
            for r in session.scalars(
                select(Sandbox).where(
                    Sandbox.installation == settings.installation_id,
                    Sandbox.state.in_([s.value for s in LIVE_STATES]),
                )
            )
        }
        jobs = {j.name: j for j in session.scalars(select(Job))}
        pod_nonces = {p.nonce for p in pods}
        report.live_rows = len(rows)
        missing_nonces = [
            p.nonce
            for p in pods
            if p.installation == settings.installation_id and p.nonce and p.nonce not in rows
        ]
        terminal = (
            {
                r.nonce: r
                for r in session.scalars(select(Sandbox).where(Sandbox.nonce.in_(missing_nonces)))
            }
            if missing_nonces
            else {}
        )
    for pod in pods:
        _judge_pod(
            provider,
            report,
            pod,
            rows.get(pod.nonce or "") or terminal.get(pod.nonce or ""),
            jobs=jobs,
            now=listed_at,
        )
    for row in rows.values():
        if row.nonce not in pod_nonces:
            _judge_podless_row(provider, report, row, listed_at)
    _close_resolved_leaks(provider, {p.name for p in pods}, report)


def _act(provider: Provider, report: GcReport, row: Sandbox, action: str, why: str) -> None:
    report.actions.append({"sandbox": row.id, "pod": row.pod_name, "action": action, "why": why})
    if report.dry_run:
        return
    try:
        with provider.sessions.begin() as session:
            store.record_leak(session, why, store.Subject.of_row(row), namespace=row.namespace)
        provider.release(row.id, actor="gc", reason=why, creator_gone=why == "stuck_create")
        with provider.sessions.begin() as session:
            fresh = session.get(Sandbox, row.id)
            done = fresh is not None and fresh.state == State.DELETED
            for leak in session.scalars(
                select(Leak).where(Leak.sandbox_id == row.id, Leak.resolved_at.is_(None))
            ):
                if done:
                    leak.resolved_at, leak.resolution, leak.resolved_by = utcnow(), action, "gc"
    except (SandmanError, OSError) as exc:
        report.errors.append(f"{row.pod_name}: {type(exc).__name__}: {exc}")


def _expired(moment: dt.datetime | None, now: dt.datetime) -> bool:
    return moment is not None and moment < now


def _judge_pod(
    provider: Provider,
    report: GcReport,
    pod: PodInfo,
    row: Sandbox | None,
    *,
    jobs: dict[str, Job],
    now: dt.datetime,
) -> None:
    settings = provider.settings
    if pod.installation != settings.installation_id:
        report.foreign_pods.append(pod.name)
        return
    if row is None or row.pod_name != pod.name:
        report.unowned_pods.append(pod.name)
        _open_leak(provider, report, "unowned_pod", pod)
        return
    state = State(row.state)
    job = jobs.get(row.job)
    if state in (State.DELETED, State.FAILED, State.RELEASING):
        if state == State.FAILED and row.creating_at is None:
            return
        _delete_late(provider, report, row, pod, state)
    elif state in (State.REQUESTED, State.CREATING) and _expired(row.lease_expires_at, now):
        _act(provider, report, row, "released", "stuck_create")
    elif state == State.ABANDONED:
        _act(provider, report, row, "released", "abandoned")
    elif (
        state == State.READY and row.acquired_at is not None and _expired(row.lease_expires_at, now)
    ):
        _abandon(provider, report, row)
    elif (
        state == State.READY
        and row.acquired_at is None
        and job is not None
        and row.ready_at
        and (now - row.ready_at).total_seconds() > _warm_idle_s(job, settings.idle_timeout_s)
    ):
        _act(provider, report, row, "released", "idle")


def _warm_idle_s(job: Job, default_s: float) -> float:
    """The longest idle timeout of the job's warm pools: a never-handed-out sandbox idle
    past it is one no pool's own upkeep (``broker.pools.upkeep``) kept, so the GC may."""
    idle = [float(p.get("idle_timeout_s") or default_s) for p in job.warm_pools or []]
    return max([default_s, *idle])


def _abandon(provider: Provider, report: GcReport, row: Sandbox) -> None:
    if not report.dry_run:
        with provider.sessions.begin() as session:
            fresh = store.lock_row(session, row.id)
            if (
                fresh is None
                or fresh.state != State.READY
                or not _expired(fresh.lease_expires_at, utcnow())
            ):
                return  # heartbeat arrived meanwhile
            store.transition(
                session, fresh, State.ABANDONED, actor="gc", detail={"reason": "lease expired"}
            )
    _act(provider, report, row, "released", "abandoned")


def _delete_late(
    provider: Provider, report: GcReport, row: Sandbox, pod: PodInfo, state: State
) -> None:
    """A pod whose row is closed or closing: delete it, by nonce, and confirm."""
    if state != State.RELEASING and not pod.deleting:
        report.late_pods.append(pod.name)
    report.actions.append(
        {"sandbox": row.id, "pod": pod.name, "action": "deleted", "why": f"pod-of-{state}-row"}
    )
    if report.dry_run:
        return
    try:
        if state == State.DELETED:
            provider.backend.delete(pod.namespace, pod.name, row.nonce)
            with provider.sessions.begin() as session:
                store.record_leak(
                    session,
                    "late_pod",
                    store.Subject(row.id, row.job, pod.name, row.nonce),
                    namespace=pod.namespace,
                    resolved_at=utcnow(),
                    resolution="deleted",
                    resolved_by="gc",
                )
        else:
            provider.release(row.id, actor="gc", reason="pending-delete")
    except (SandmanError, OSError) as exc:
        report.errors.append(f"{pod.name}: {type(exc).__name__}: {exc}")


def _judge_podless_row(
    provider: Provider, report: GcReport, row: Sandbox, now: dt.datetime
) -> None:
    state = State(row.state)
    recent = (now - row.requested_at).total_seconds() < RECENT_S
    if state == State.FAILED or recent:
        return
    if state == State.READY:
        if row.ready_at and (now - row.ready_at).total_seconds() < RECENT_S:
            return
        if provider.backend.get(row.namespace, row.pod_name) is not None:
            return  # created after our list; not dangling
        report.dangling_rows.append(row.id)
        _act(provider, report, row, "closed", "pod_lost")
    elif state in (State.RELEASING, State.ABANDONED):
        _act(provider, report, row, "closed", "pending_delete")
    elif state in (State.REQUESTED, State.CREATING) and _expired(row.lease_expires_at, now):
        report.dangling_rows.append(row.id)
        _act(provider, report, row, "closed", "stuck_create")


def _open_leak(provider: Provider, report: GcReport, kind: str, pod: PodInfo) -> None:
    if report.dry_run:
        return
    with provider.sessions.begin() as session:
        exists = session.scalars(
            select(Leak).where(
                Leak.pod_name == pod.name, Leak.kind == kind, Leak.resolved_at.is_(None)
            )
        ).first()
        if exists is None:
            about = store.Subject(None, pod.labels.get(names.LABEL_JOB), pod.name, pod.nonce)
            store.record_leak(
                session,
                kind,
                about,
                namespace=pod.namespace,
                detail={
                    "labels": pod.labels,
                    "reason": "no ledger row matches this pod's nonce: not provably ours",
                },
            )


def _close_resolved_leaks(provider: Provider, present: set[str], report: GcReport) -> None:
    """Open unowned-pod leaks whose pod is gone are closed as resolved elsewhere."""
    if report.dry_run:
        return
    with provider.sessions.begin() as session:
        for leak in session.scalars(
            select(Leak).where(Leak.resolved_at.is_(None), Leak.kind == "unowned_pod")
        ):
            if leak.pod_name not in present:
                leak.resolved_at, leak.resolution, leak.resolved_by = utcnow(), "gone", "gc"


__all__ = ["GcReport", "OwnershipError", "run_gc"]
