"""Capture a sandbox's workspace into the blob store, restore it into another sandbox.

Runs in a worker (the acquire queue's), never in the trainer: the worker holds the ledger
(quota, ownership rows) and the store, and the bytes go execd -> worker -> store and back
over HTTP, never through a Celery message (a message carries ids only).

Capture, in the order that keeps a crash harmless:
1. execd lists the roots (kind, mode, size, SHA-256 or link target) and the shell state;
2. the quota is checked against the listing: a refusal writes nothing;
3. the row is committed ``capturing`` (the intent: from here on the GC owns the rest);
4. each blob the store lacks is streamed from execd into the store, hashed on the way
   (a blob already stored is only touched: dedup across snapshots);
5. the manifest is written, the row becomes ``ready``.
A worker that dies between 3 and 5 leaves a ``capturing`` row the GC deletes past the
grace, and blobs the store sweep deletes once no manifest names them.

Restore: execd prepares the fresh sandbox (deletes what the manifest lacks, creates its
directories, lists the files whose content differs), the worker streams those blobs in
(execd verifies each SHA-256 while writing), execd sets links and modes, rescans and
compares the whole tree, then re-applies the shell's cwd and exported variables. A
mismatch anywhere is ``SnapshotCorrupt``; the caller releases the sandbox.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker import failpoints
from broker.errors import (
    ExecError,
    InvalidRequest,
    QuotaExceeded,
    SandboxLost,
    SnapshotCorrupt,
    SnapshotNotFound,
    SnapshotQuotaExceeded,
)
from broker.ledger import store as ledger
from broker.ledger.models import Job, Sandbox, Snapshot, Tenant, utcnow
from broker.ledger.states import State
from broker.snapshots.store import BlobStore, LocalBlobs, manifest_blobs
from broker.wire.execd import Call, Endpoint, decode, shared_http, transport_failure

log = logging.getLogger(__name__)

CAPTURING, READY, FAILED, DELETED = "capturing", "ready", "failed", "deleted"
LIVE_STATES = (CAPTURING, READY)
CALL_S = 600.0  # a listing or a verify of a large tree hashes everything once
HELD = (State.READY,)  # handed out or warm: a live sandbox whose execd answers
CORRUPT_CODES = frozenset({"blob_mismatch", "restore_mismatch"})
MAX_TTL_S = 90 * 86400.0
# A sandbox's inbox: its host directory and where the sandbox sees it (read-only).
Inbox = tuple[Path, str]


def summary(row: Snapshot) -> dict[str, Any]:
    """The wire form of a snapshot (the client's ``Snapshot``)."""
    return {
        "id": row.id,
        "job": row.job,
        "image": row.image,
        "image_digest": row.image_digest,
        "size": row.size_b,
        "files": row.files,
        "stored": row.stored_b,
        "created": row.created_at.isoformat(),
        "expires": row.expires_at.isoformat(),
        "sandbox_id": row.sandbox_id,
        "state": row.state,
    }


def image_of(row: Sandbox) -> str | None:
    """The digest a sandbox runs, as precisely as the ledger knows it."""
    return row.image_resolved or row.image_digest


class SnapshotService:
    """Capture and restore; one per worker process."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        store: BlobStore,
        token_for: Callable[[Sandbox], str],
        *,
        installation: str,
        default_ttl_s: float = 86400.0,
        failpoint: Callable[[str], None] = failpoints.off,
        http: httpx.Client | None = None,
        inbox_for: Callable[[Sandbox], Inbox | None] = lambda row: None,
    ) -> None:
        self.sessions = sessions
        self.store = store
        self.installation = installation
        self.token_for = token_for
        self.default_ttl_s = default_ttl_s
        self.failpoint = failpoint
        self.http = http or shared_http()
        self.inbox_for = inbox_for

    # -- execd -------------------------------------------------------------------------

    def _endpoint(self, sandbox_id: str, owner: str | None) -> tuple[Sandbox, Endpoint]:
        """The sandbox's execd, refused when another trainer holds it: a restore empties
        the roots first, so a wrong id must never reach someone else's sandbox. (A warm
        sandbox whose hand-out is still queued has no owner yet and is allowed.)"""
        with self.sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.state not in HELD or not row.address:
                raise SandboxLost(f"sandbox {sandbox_id} is not live")
            if owner and row.owner and row.owner != owner:
                raise InvalidRequest(f"sandbox {sandbox_id} is held by another trainer")
            session.expunge(row)
        return row, Endpoint(row.address, self.token_for(row), who=f"execd of {sandbox_id}")

    def _call(self, ep: Endpoint, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return ep.send(self.http, Call("POST", path, body, CALL_S))
        except ExecError as exc:
            if exc.error_code in CORRUPT_CODES:
                raise SnapshotCorrupt(str(exc)) from exc
            raise

    def _pull(self, ep: Endpoint, path: str, sha: str) -> int:
        """One file's bytes from execd straight into the store (a megabyte at a time)."""
        call = Call("POST", "/v1/snapshot/blob", {"path": path}, CALL_S)
        try:
            with self.http.stream(
                "POST", ep.base + call.path, json=call.body, headers=ep.headers, timeout=CALL_S
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    decode(resp.status_code, resp.content, call, ep.who)
                return self.store.put_stream(sha, resp.iter_bytes(1 << 20))
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, ep.who) from exc

    def _push(self, ep: Endpoint, need: list[dict[str, Any]], modes: dict[str, int]) -> None:
        """The files a restore needs, from the store into the sandbox as one streamed pack
        (per file a JSON head line, then its bytes); execd verifies each as it lands."""
        heads = [
            json.dumps(
                {"p": e["p"], "s": self.store.size(e["d"]), "d": e["d"], "m": modes[e["p"]]},
                separators=(",", ":"),
            ).encode()
            + b"\n"
            for e in need
        ]
        length = sum(len(h) + self.store.size(e["d"]) for h, e in zip(heads, need, strict=True))

        def pack() -> Iterator[bytes]:
            for i, (head, entry) in enumerate(zip(heads, need, strict=True)):
                if i:
                    self.failpoint("restore-mid-put")
                yield head
                yield from self.store.chunks(entry["d"])

        call = Call("POST", "/v1/snapshot/put", None, CALL_S)
        headers = {**ep.headers, "Content-Length": str(length)}
        try:
            resp = self.http.request(
                "PUT", ep.base + call.path, content=pack(), headers=headers, timeout=CALL_S
            )
        except httpx.HTTPError as exc:
            raise transport_failure(exc, call, ep.who) from exc
        try:
            decode(resp.status_code, resp.content, call, ep.who)
        except ExecError as exc:
            if exc.error_code in CORRUPT_CODES:
                raise SnapshotCorrupt(str(exc)) from exc
            raise

    def _copy_local(
        self, row: Sandbox, ep: Endpoint, need: list[dict[str, Any]], modes: dict[str, int]
    ) -> bool:
        """The files a restore needs, without streaming them: when the store's blobs are
        files on this host and the backend gives the sandbox an inbox on the same disk,
        hard-link the needed blobs (and only those) into a fresh directory of it, and
        execd copies and verifies them from there. False when that is not possible (an
        S3 store, Kubernetes, another filesystem): the caller streams instead."""
        inbox = self.inbox_for(row)
        if inbox is None or not isinstance(self.store, LocalBlobs):
            return False
        host, inside = inbox
        drop = host / secrets.token_hex(8)
        try:
            drop.mkdir()
            for sha in {e["d"] for e in need}:
                os.link(self.store.local_path(sha), drop / sha)
        except OSError as exc:
            log.info("restore into %s streams its blobs: %s", row.id, exc)
            shutil.rmtree(drop, ignore_errors=True)
            return False
        except BaseException:
            shutil.rmtree(drop, ignore_errors=True)
            raise
        files = [{"p": e["p"], "s": int(e["s"]), "d": e["d"], "m": modes[e["p"]]} for e in need]
        try:
            self.failpoint("restore-mid-copy")
            self._call(ep, "/v1/snapshot/copy", {"dir": f"{inside}/{drop.name}", "files": files})
        finally:
            shutil.rmtree(drop, ignore_errors=True)
        return True

    # -- capture -----------------------------------------------------------------------

    def capture(
        self,
        sandbox_id: str,
        *,
        paths: list[str] | None = None,
        ttl_s: float | None = None,
        owner: str | None = None,
    ) -> dict[str, Any]:
        ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
        if not 0 < ttl <= MAX_TTL_S:
            raise InvalidRequest(f"snapshot ttl {ttl} s outside (0, {MAX_TTL_S:.0f}]")
        if paths is not None and (
            not isinstance(paths, list) or not all(isinstance(p, str) for p in paths)
        ):
            raise InvalidRequest("paths must be a list of absolute paths", field="paths")
        row, ep = self._endpoint(sandbox_id, owner)
        body: dict[str, Any] = {} if paths is None else {"roots": paths}
        try:
            listing = ep.send(self.http, Call("POST", "/v1/snapshot/capture", body, CALL_S))
        except ExecError as exc:
            raise InvalidRequest(f"cannot capture: {exc}") from exc
        files = [e for e in listing["entries"] if e["k"] == "f"]
        size = sum(int(e["s"]) for e in files)
        snap_id = self._intent(row, size, len(files), ttl)
        try:
            stored = self._store_blobs(ep, files)
            self.failpoint("snapshot-after-blobs")
            manifest = {
                "id": snap_id,
                "image": row.image,
                "image_digest": image_of(row),
                "roots": listing["roots"],
                "entries": listing["entries"],
                "session": listing["session"],
            }
            self.store.put_manifest(snap_id, manifest)
        except BaseException as exc:
            self._settle(snap_id, FAILED, f"{type(exc).__name__}: {exc}"[:2000])
            raise
        with self.sessions.begin() as session:
            snap = session.get(Snapshot, snap_id)
            assert snap is not None
            snap.state, snap.stored_b = READY, stored
            session.flush()
            return summary(snap)

    def _intent(self, row: Sandbox, size: int, files: int, ttl: float) -> str:
        """The quota check and the ``capturing`` row, in one transaction (the job row is
        locked so two captures of one job cannot both slip under its quota)."""
        with self.sessions.begin() as session:
            job = session.execute(
                select(Job).where(Job.name == row.job).with_for_update()
            ).scalar_one()
            if job.snapshot_bytes is not None:
                held = sum(s for s, _ in _live_sizes(session, Snapshot.job == job.name))
                if held + size > job.snapshot_bytes:
                    raise SnapshotQuotaExceeded(
                        f"job {job.name}: snapshots would hold {held + size} bytes,"
                        f" over its quota of {job.snapshot_bytes}"
                    )
            tenant = session.get(Tenant, job.tenant) if job.tenant else None
            if tenant is not None and tenant.snapshot_bytes is not None:
                ledger.lock_tenant_snapshots(session, tenant.name)
                check_tenant_bytes(session, tenant.name, tenant.snapshot_bytes, size)
            snap = Snapshot(
                job=row.job,
                tenant=job.tenant,
                installation=self.installation,
                sandbox_id=row.id,
                image=row.image,
                image_digest=image_of(row),
                state=CAPTURING,
                size_b=size,
                files=files,
                expires_at=utcnow() + dt.timedelta(seconds=ttl),
            )
            session.add(snap)
            session.flush()
            return snap.id

    def _store_blobs(self, ep: Endpoint, files: list[dict[str, Any]]) -> int:
        """Blobs already stored are touched, all in one call, before any is pulled."""
        seen = self.store.touch_all(e["d"] for e in files)
        stored = 0
        for entry in files:
            sha = entry["d"]
            if sha in seen:
                continue
            if stored:
                self.failpoint("snapshot-between-blobs")
            stored += self._pull(ep, entry["p"], sha)
            seen.add(sha)
        return stored

    def _settle(self, snap_id: str, state: str, error: str | None = None) -> None:
        try:
            with self.sessions.begin() as session:
                snap = session.get(Snapshot, snap_id)
                if snap is not None:
                    snap.state, snap.last_error = state, error
                    if state == DELETED:
                        snap.deleted_at = utcnow()
        except Exception:  # the GC settles a capturing row past the grace anyway
            log.exception("could not mark snapshot %s %s", snap_id, state)

    # -- restore -----------------------------------------------------------------------

    def describe(self, snapshot_id: str) -> dict[str, Any]:
        with self.sessions() as session:
            snap = session.get(Snapshot, snapshot_id)
            if snap is None or snap.state != READY or snap.expires_at <= utcnow():
                raise SnapshotNotFound(f"no ready snapshot {snapshot_id}")
            return summary(snap)

    def restore(
        self, sandbox_id: str, snapshot_id: str, *, owner: str | None = None
    ) -> dict[str, Any]:
        snap = self.describe(snapshot_id)
        row, ep = self._endpoint(sandbox_id, owner)
        if snap["image_digest"] != image_of(row) or snap["image"] != row.image:
            raise InvalidRequest(
                f"snapshot {snapshot_id} is of {snap['image']}@{snap['image_digest']}, the"
                f" sandbox runs {row.image}@{image_of(row)}"
            )
        manifest = self.store.manifest(snapshot_id)
        if manifest is None:
            raise SnapshotCorrupt(f"snapshot {snapshot_id} has no manifest in the store")
        listing = {"roots": manifest["roots"], "entries": manifest["entries"]}
        t0 = time.perf_counter()
        need = self._call(ep, "/v1/snapshot/prepare", listing)["need"]
        self.failpoint("restore-after-prepare")
        t1, how = time.perf_counter(), "nothing"
        if need:
            modes = {e["p"]: int(e["m"]) for e in manifest["entries"]}
            how = "copied"
            if not self._copy_local(row, ep, need, modes):
                self._push(ep, need, modes)
                how = "streamed"
        t2 = time.perf_counter()
        self._call(ep, "/v1/snapshot/finish", {**listing, "session": manifest["session"]})
        log.info(
            "restore %s into %s: prepare %.3fs, %d files (%d bytes) %s in %.3fs, finish %.3fs",
            snapshot_id, sandbox_id, t1 - t0, len(need), sum(int(e["s"]) for e in need), how,
            t2 - t1, time.perf_counter() - t2,
        )  # fmt: skip
        return {"snapshot": snap, "written": len(need)}

    # -- ownership ---------------------------------------------------------------------

    def remove(self, snapshot_id: str) -> bool:
        """Delete the row's manifest and mark it deleted; its blobs go with the sweep."""
        with self.sessions() as session:
            snap = session.get(Snapshot, snapshot_id)
            if snap is None or snap.state == DELETED or snap.installation != self.installation:
                return False
        self.store.delete_manifest(snapshot_id)
        self._settle(snapshot_id, DELETED)
        return True

    def rows(self, *, job: str | None = None, every: bool = False) -> list[dict[str, Any]]:
        with self.sessions() as session:
            q = (
                select(Snapshot)
                .where(Snapshot.installation == self.installation)
                .order_by(Snapshot.created_at, Snapshot.id)
            )
            if job is not None:
                q = q.where(Snapshot.job == job)
            if not every:
                q = q.where(Snapshot.state != DELETED)
            return [summary(s) for s in session.scalars(q)]


def _live_sizes(session: Session, whose: Any) -> list[tuple[int, dt.datetime]]:
    """Size and expiry of each live, unexpired snapshot matching ``whose``, soonest first:
    an expired one no longer counts (it is not found any more; the GC deletes it)."""
    stmt = (
        select(Snapshot.size_b, Snapshot.expires_at)
        .where(whose, Snapshot.state.in_(LIVE_STATES), Snapshot.expires_at > utcnow())
        .order_by(Snapshot.expires_at)
    )
    return [(int(s), at) for s, at in session.execute(stmt).all()]


def check_tenant_bytes(session: Session, tenant: str, quota: int, size: int) -> None:
    """Refuse a capture of ``size`` bytes that would put ``tenant`` over its quota.

    A snapshot larger than the whole quota can never fit: ``SnapshotQuotaExceeded``
    (permanent). Otherwise ``QuotaExceeded`` with ``retry_after`` exact: when enough of
    the tenant's snapshots have expired for this one to fit (removing some frees room
    at once)."""
    if size > quota:
        raise SnapshotQuotaExceeded(
            f"tenant {tenant}: a snapshot of {size} bytes is over its whole quota of {quota}"
        )
    live = _live_sizes(session, Snapshot.tenant == tenant)
    held = sum(s for s, _ in live)
    if held + size <= quota:
        return
    # size <= quota, so room comes at the latest when every live one has expired
    freed, room_at = 0, live[-1][1]
    for s, expires_at in live:
        freed += s
        if held - freed + size <= quota:
            room_at = expires_at
            break
    raise QuotaExceeded(
        f"tenant {tenant}: snapshots would hold {held + size} bytes, its quota is {quota}",
        tenant=tenant,
        quota="snapshot_bytes",
        retry_after=round(max((room_at - utcnow()).total_seconds(), 0.001), 3),
    )


def referenced_blobs(store: BlobStore, ids: list[str]) -> Iterator[str]:
    for snap_id in ids:
        manifest = store.manifest(snap_id)
        if manifest is not None:
            yield from manifest_blobs(manifest)
