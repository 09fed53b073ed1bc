"""A worker killed in the middle of a fork, on either backend: what must be left afterwards.

The acquire worker (which also runs captures and restores) is armed with one of the
snapshot failpoints (broker/failpoints.py; ``os._exit`` there, exactly a SIGKILL at that
line), a second worker serves releases. The trainer forks a sandbox holding two new
files (two blobs, two files to put), so every point is reached on every run:
- ``snapshot-between-blobs``: the row is ``capturing``, one blob stored, one not;
- ``snapshot-after-blobs``: both blobs stored, no manifest;
- ``restore-after-prepare``: the forks were acquired, a restore prepared one, no file written;
- ``restore-mid-put``: a restore sent its first file to execd, the second never (on the
  local backend with its local copy off, so that its restores stream as on Kubernetes);
- ``restore-mid-copy`` (local backend): a restore linked its blobs into the sandbox's
  inbox and never asked execd to copy them.
A dead capture's trainer times out (``AcquireTimeout``); a dead restore's forks are each a
typed error (all settled) and the trainer releases them. Then, after one GC pass with no
grace: no live sandbox row of the job and no sandbox (process or pod) of the
installation, no ``capturing`` row, the dead capture's row deleted and its blobs gone (a
complete snapshot stays ready with its blobs), every blob and manifest in the store
named by a live snapshot, and ``sandman audit`` OK with nothing unowned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from broker import failpoints
from broker.backends.factory import make_backend
from broker.client.sync import SandboxClient
from broker.errors import AcquireTimeout
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Sandbox, Snapshot
from broker.ledger.states import State
from broker.names import Queue
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.snapshots.service import CAPTURING, LIVE_STATES
from broker.snapshots.store import manifest_blobs, open_store
from tests.support.ownbroker import OwnBroker
from tests.support.wait import wait_until

CAPTURE_POINTS = ("snapshot-between-blobs", "snapshot-after-blobs")
RESTORE_POINTS = ("restore-after-prepare", "restore-mid-put")
POINTS = CAPTURE_POINTS + RESTORE_POINTS
# On Kubernetes a dead restore costs its trainer the whole acquire timeout (90 s there), so
# the cluster runs the restore window that writes into the pod; the window before any
# write is the same ledger and store state on both backends, covered locally.
KUBE_POINTS = (*CAPTURE_POINTS, "restore-mid-put")
LOCAL_COPY_POINT = "restore-mid-copy"  # the local backend's restores copy from an inbox
SANDMAN = Path(sys.executable).parent / "sandman"


def kill_mid_fork(
    broker: OwnBroker,
    point: str,
    *,
    spec: dict[str, Any],
    job_config: dict[str, Any] | None = None,
    running: Callable[[], set[str]] | None = None,
) -> None:
    """Fork on a worker that dies at ``point``; assert nothing is left unowned after a GC.

    ``spec`` is the acquire's (image, timeout, resources): its timeout is also how long
    the trainer waits for a dead restore.

    ``running`` names the sandboxes that still run, judged independently of the ledger
    (the local tests scan /proc); by default the backend's listing of the installation."""
    assert point in (*POINTS, LOCAL_COPY_POINT), point
    job = broker.job(f"forked-{point}", **(job_config or {}))
    broker.start_worker("releaser", f"{Queue.RELEASE},{Queue.POOL}")
    doomed = broker.start_worker(
        f"acquire-doomed-{point}", Queue.ACQUIRE.value, env={"SANDMAN_FAILPOINT": point}
    )
    contents = [f"{name} of the fork killed at {point}\n".encode() for name in ("a", "b")]
    client = SandboxClient(broker.redis_url, owner="pytest")
    try:
        sb = client.open(job=job, **spec)
        for name, content in zip(("a", "b"), contents, strict=True):
            sb.write_file(f"/workspace/{name}", content)
        if point in CAPTURE_POINTS:
            with pytest.raises(AcquireTimeout):
                sb.fork(2, timeout=10)
        else:
            forks = sb.fork(2)
            assert [type(f) for f in forks] == [AcquireTimeout, AcquireTimeout], forks
        sb.release()
    finally:
        client.close()
    assert doomed.wait(timeout=60) == failpoints.EXIT_CODE
    timeout = float(spec["timeout"])
    settings = dataclasses.replace(broker.settings, snapshot_grace_s=0.0)
    engine = make_engine(broker.database_url, pool_size=2, max_overflow=0)
    sessions = make_session_factory(engine)
    provider = Provider(settings, sessions, make_backend(settings, ensure_namespace=False))
    try:

        def live_rows() -> list[str]:
            with sessions() as session:
                return sorted(
                    session.scalars(
                        select(Sandbox.id).where(Sandbox.job == job, Sandbox.state != State.DELETED)
                    )
                )

        def listed() -> set[str]:
            pods = provider.backend.list_installation(settings.namespace, settings.installation_id)
            return {p.name for p in pods}

        wait_until(lambda: not live_rows(), timeout=timeout, what="every sandbox released")
        wait_until(lambda: not (running or listed)(), timeout=timeout, what="none running")
        store = open_store(settings)
        shas = {hashlib.sha256(c).hexdigest() for c in contents}
        # The window was hit: what the dead worker left before the GC
        before = {"snapshot-between-blobs": 1, "snapshot-after-blobs": 2}.get(point, 2)
        assert sum(store.has(sha) for sha in shas) == before, point
        assert list(_states(sessions, job).values()) == [
            "capturing" if point in CAPTURE_POINTS else "ready"
        ]
        report = run_gc(provider)
        assert report.errors == [], report.errors
        states = _states(sessions, job)
        if point in CAPTURE_POINTS:
            assert list(states.values()) == ["deleted"]  # the dead capture's row, collected
            assert not any(store.has(sha) for sha in shas)  # and every blob it stored
        else:
            assert list(states.values()) == ["ready"]  # the snapshot itself was complete
            assert all(store.has(sha) for sha in shas)
        with sessions() as session:  # no capture left hanging, of any job
            assert not session.scalars(select(Snapshot.id).where(Snapshot.state == CAPTURING)).all()
        live = {i for i, s in states.items() if s in LIVE_STATES}
        named: set[str] = set()
        for snap_id in live:
            manifest = store.manifest(snap_id)
            assert manifest is not None, snap_id
            named |= manifest_blobs(manifest)
        assert {sha for sha, _ in store.blobs()} <= named  # no blob nobody names
        assert set(store.manifests()) == live
        _audit_is_clean(broker)
    finally:
        close = getattr(provider.backend, "close", None)  # the Kubernetes client's pools
        if close is not None:
            close()
        engine.dispose()


def _states(sessions: Any, job: str) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(select(Snapshot.id, Snapshot.state).where(Snapshot.job == job))
        return {snap_id: state for snap_id, state in rows}


def _audit_is_clean(broker: OwnBroker) -> None:
    """``sandman audit --json``, the operator's command, against this broker."""
    proc = subprocess.run(
        [str(SANDMAN), "audit", "--json"],
        env=broker.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    for key in ("unowned_pods", "late_pods", "dangling_rows"):
        assert report[key] == [], (key, report)
    for key in ("rows_without_blobs", "blobs_without_rows", "manifests_without_rows"):
        assert report["snapshots"][key] == [], (key, report)
    assert sum(report["pods_by_job"].values()) == 0, report
