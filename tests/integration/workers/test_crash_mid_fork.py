"""A worker killed in the middle of a fork leaves no unowned sandbox and no unowned blob.

Two windows, each hit every time by a failpoint (``os._exit``, like a SIGKILL there):
- ``snapshot-after-blobs``: the capture stored its blobs, the row is ``capturing``, no
  manifest. The trainer's wait times out; the GC deletes the row and the blobs.
- ``restore-after-prepare``: the forks were acquired, a restore prepared one, no file
  written. The trainer's waits time out and it releases both forks (all settled: each is
  a typed error); the snapshot itself stays ready and keeps its blobs.
Afterwards the kernel shows no sandbox of this state dir, the ledger none live, and the
audit no blob without a row. The first window runs on both blob stores (S3: a real server,
tests/support/s3server.py): its blobs are objects the GC must find and delete.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from sqlalchemy import select

from broker import failpoints
from broker.backends.local import LocalBackend
from broker.client.sync import SandboxClient
from broker.errors import AcquireTimeout
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Sandbox, Snapshot
from broker.ledger.states import State
from broker.names import Queue
from broker.ownership.audit import run_audit
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.snapshots.store import open_store
from tests.integration.workers.conftest import OwnBroker
from tests.integration.workers.test_crash_mid_create import _running_sandboxes
from tests.support.blobstores import BUCKET
from tests.support.images import TASK_IMAGE
from tests.support.s3server import S3Server
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("point", "store_kind"),
    [
        ("snapshot-after-blobs", "fs"),
        ("restore-after-prepare", "fs"),
        ("snapshot-after-blobs", "s3"),  # the orphaned blobs are S3 objects the GC deletes
    ],
)
def test_a_worker_killed_mid_fork_leaves_nothing_unowned(
    own_broker: OwnBroker, point: str, store_kind: str, request: pytest.FixtureRequest
) -> None:
    if store_kind == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        url = f"s3://{server.bucket(BUCKET)}/crash-{own_broker.settings.installation_id}"
        own_broker.settings = dataclasses.replace(own_broker.settings, **server.fields(url))
    job = own_broker.job("forked")
    own_broker.start_worker("releaser", f"{Queue.RELEASE},{Queue.POOL}")
    doomed = own_broker.start_worker(
        "acquire-doomed", Queue.ACQUIRE.value, env={"SANDMAN_FAILPOINT": point}
    )
    content = f"only in this fork test: {point}\n".encode()
    sha = hashlib.sha256(content).hexdigest()
    client = SandboxClient(own_broker.redis_url, owner="pytest")
    try:
        sb = client.open(image=TASK_IMAGE, job=job, timeout=20)
        sb.write_file("/workspace/data", content)
        if point == "snapshot-after-blobs":
            with pytest.raises(AcquireTimeout):
                sb.fork(2, timeout=10)
        else:
            forks = sb.fork(2)
            assert [type(f) for f in forks] == [AcquireTimeout, AcquireTimeout]
        sb.release()
    finally:
        client.close()
    assert doomed.wait(timeout=60) == failpoints.EXIT_CODE
    settings = dataclasses.replace(own_broker.settings, snapshot_grace_s=0.0)
    engine = make_engine(own_broker.database_url, pool_size=2, max_overflow=0)
    sessions = make_session_factory(engine)
    provider = Provider(settings, sessions, LocalBackend(settings), actor="gc")
    state_dir = settings.state_dir
    try:

        def live_rows() -> list[str]:
            with sessions() as session:
                return sorted(
                    session.scalars(
                        select(Sandbox.id).where(Sandbox.job == job, Sandbox.state != State.DELETED)
                    )
                )

        wait_until(lambda: not live_rows(), timeout=60, what="every sandbox released")
        wait_until(lambda: not _running_sandboxes(state_dir), timeout=60, what="none running")
        report = run_gc(provider)
        assert report.errors == []
        with sessions() as session:
            states = list(session.scalars(select(Snapshot.state).where(Snapshot.job == job)))
        store = open_store(settings)
        if point == "snapshot-after-blobs":
            assert states == ["deleted"]  # the dead capture's row, collected
            assert not store.has(sha)  # and its blob
        else:
            assert states == ["ready"]  # the snapshot itself was complete
            assert store.has(sha)
        audit = run_audit(provider)
        assert audit.ok, audit.to_dict()
        assert audit.snapshots["blobs_without_rows"] == []
        assert audit.snapshots["rows_without_blobs"] == []
        assert sum(audit.pods_by_job.values()) == 0
    finally:
        engine.dispose()
