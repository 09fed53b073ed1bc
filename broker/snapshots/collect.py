"""The GC's and the audit's share of snapshots: rows, manifests and blobs agree.

Collected (``collect``), in an order that never deletes what a live snapshot needs:
1. ready rows past ``expires_at`` (expired) and ``capturing``/``failed`` rows older than
   the grace (their worker died or gave up): manifest deleted, row ``deleted``;
2. manifests whose row is missing or deleted;
3. blobs no remaining manifest names, once older than the grace (a capture in progress
   stores or touches its blobs before its manifest exists; the grace spares them);
4. temporary files a crashed writer left.
Steps 2-4 read every manifest, so they run at most once per ``SWEEP_EVERY_S`` (or per
grace, when shorter); step 1 runs on every pass.

The audit (``audit``) only reports: ready rows whose manifest or blobs are missing
(``rows_without_blobs``) and blobs or manifests no live row owns (``blobs_without_rows``,
``manifests_without_rows``).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.ledger.models import Snapshot, utcnow
from broker.snapshots.service import CAPTURING, DELETED, FAILED, READY
from broker.snapshots.store import BlobStore, manifest_blobs

SWEEP_EVERY_S = 300.0  # at most one manifest and blob sweep per this (or the grace)


@dataclass
class Collected:
    expired: int = 0
    orphaned: int = 0
    manifests: int = 0
    blobs: int = 0
    blob_bytes: int = 0
    tmp: int = 0
    swept: bool = True  # whether this pass swept manifests and blobs (see SWEEP_EVERY_S)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect(
    sessions: sessionmaker[Session], store: BlobStore, *, installation: str, grace_s: float
) -> Collected:
    out = Collected()
    now = utcnow()
    stale = now - dt.timedelta(seconds=grace_s)
    with sessions.begin() as session:
        doomed = session.execute(
            select(Snapshot.id, Snapshot.state).where(
                Snapshot.installation == installation,
                or_(
                    (Snapshot.state == READY) & (Snapshot.expires_at <= now),
                    Snapshot.state.in_((CAPTURING, FAILED)) & (Snapshot.created_at <= stale),
                ),
            )
        ).all()
        for snap_id, state in doomed:
            store.delete_manifest(snap_id)
            if state == READY:
                out.expired += 1
            else:
                out.orphaned += 1
        if doomed:
            session.execute(
                update(Snapshot)
                .where(Snapshot.id.in_([d[0] for d in doomed]))
                .values(state=DELETED, deleted_at=now)
            )
    if grace_s > 0 and time.time() - store.last_sweep() < min(grace_s, SWEEP_EVERY_S):
        out.swept = False  # a sweep reads every manifest: not on every 30 s pass
        return out
    store.mark_sweep()
    live = _live_ids(sessions, installation)
    for snap_id in store.manifests():
        if snap_id not in live:
            store.delete_manifest(snap_id)
            out.manifests += 1
    wanted = _referenced(store, live)
    cutoff = time.time() - grace_s
    for sha, mtime in list(store.blobs()):
        if sha not in wanted and mtime <= cutoff:
            out.blob_bytes += store.size(sha) if store.has(sha) else 0
            store.delete_blob(sha)
            out.blobs += 1
    out.tmp = store.sweep_tmp(grace_s)
    return out


def _live_ids(sessions: sessionmaker[Session], installation: str) -> set[str]:
    with sessions() as session:
        return set(
            session.scalars(
                select(Snapshot.id).where(
                    Snapshot.installation == installation,
                    Snapshot.state.in_((READY, CAPTURING)),
                )
            )
        )


def _referenced(store: BlobStore, ids: set[str]) -> set[str]:
    wanted: set[str] = set()
    for snap_id in ids:
        manifest = store.manifest(snap_id)
        if manifest is not None:
            wanted |= manifest_blobs(manifest)
    return wanted


def audit(
    sessions: sessionmaker[Session], store: BlobStore, *, installation: str
) -> dict[str, Any]:
    """Rows without blobs, blobs and manifests without rows (ids, sorted)."""
    with sessions() as session:
        ready = sorted(
            session.scalars(
                select(Snapshot.id).where(
                    Snapshot.installation == installation, Snapshot.state == READY
                )
            )
        )
    blobs = {sha for sha, _ in store.blobs()}
    broken = []
    wanted: set[str] = set()
    for snap_id in ready:
        manifest = store.manifest(snap_id)
        need = manifest_blobs(manifest) if manifest is not None else set()
        wanted |= need
        if manifest is None or need - blobs:
            broken.append(snap_id)
    live = _live_ids(sessions, installation)
    return {
        "snapshot_rows": len(ready),
        "rows_without_blobs": broken,
        "blobs_without_rows": sorted(blobs - wanted - _referenced(store, live)),
        "manifests_without_rows": sorted(set(store.manifests()) - live),
    }
