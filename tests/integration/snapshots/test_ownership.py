"""Snapshots are owned like pods: verified restores, quotas, expiry, dedup, the audit.

Real stack (PostgreSQL, Redis, a Celery worker, execd in bubblewrap); the blob store is
the worker's, in the stack's state dir, which the test reads and, to corrupt a blob,
writes behind the broker's back.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import secrets
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from broker.acquire import quotas
from broker.cli.main import main
from broker.errors import (
    InvalidRequest,
    QuotaExceeded,
    SnapshotCorrupt,
    SnapshotNotFound,
    SnapshotQuotaExceeded,
)
from broker.ledger import store
from broker.ledger.models import Sandbox, Snapshot, utcnow
from broker.ledger.states import State
from broker.settings import Settings
from broker.snapshots.collect import audit, collect
from broker.snapshots.store import FsBlobStore, default_store
from tests.integration.client.test_transports import Handle, Trainer
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def _job(sessions: Any, name: str, **config: Any) -> str:
    with sessions.begin() as session:
        store.ensure_job(session, name, **config)
    return name


def _blobs(stack: Settings) -> FsBlobStore:
    return default_store(stack.state_dir)


@pytest.fixture
def cli_env(stack: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sandman`` commands in this process see the test stack's ledger and store."""
    for name in ("database_url", "state_dir", "installation_id", "secret_key"):
        monkeypatch.setenv(f"SANDMAN_{name.upper()}", str(getattr(stack, name)))


def _live_sandboxes(sessions: Any, job: str) -> list[str]:
    with sessions() as session:
        return sorted(
            session.scalars(
                select(Sandbox.id).where(Sandbox.job == job, Sandbox.state != State.DELETED)
            )
        )


def test_a_corrupted_blob_fails_the_restore_and_releases_its_sandbox(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings
) -> None:
    trainer = make_trainer(owner="corrupt")
    job = _job(sessions, f"corrupt-{trainer.flavour}")
    content = b"the only copy of this content: %s\n" % job.encode()
    sb = trainer.open(image=TASK_IMAGE, job=job, timeout=60)
    try:
        sb.write_file("/workspace/data.bin", content)
        snap = sb.snapshot()
    finally:
        sb.release()
    wait_until(lambda: not _live_sandboxes(sessions, job), 120, what="source released")
    blob = _blobs(stack)._blob(hashlib.sha256(content).hexdigest())
    blob.write_bytes(b"X" + content[1:])  # same size, other bytes
    with pytest.raises(SnapshotCorrupt, match="blob_mismatch"):
        trainer.client.resume(snap.id)
    wait_until(lambda: not _live_sandboxes(sessions, job), 120, what="the failed restore released")


def test_quota_refuses_before_anything_is_written(
    make_trainer: Callable[..., Trainer], sessions: Any
) -> None:
    trainer = make_trainer(owner="quota")
    job = _job(sessions, f"snap-quota-{trainer.flavour}", snapshot_bytes=100)
    sb = trainer.open(image=TASK_IMAGE, job=job, timeout=60)
    try:
        sb.write_file("/workspace/small", b"x" * 60)
        first = sb.snapshot()
        assert first.size == 60
        with pytest.raises(SnapshotQuotaExceeded):
            sb.snapshot()  # 60 + 60 > 100
    finally:
        sb.release()
    with sessions() as session:
        rows = session.scalars(select(Snapshot.id).where(Snapshot.job == job)).all()
    assert list(rows) == [first.id]


def test_identical_files_are_stored_once_and_expired_snapshots_are_collected(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings
) -> None:
    trainer = make_trainer(owner="expiry")
    job = _job(sessions, f"snap-expiry-{trainer.flavour}")
    content = b"stored once: %s\n" % job.encode()
    sha = hashlib.sha256(content).hexdigest()
    sb = trainer.open(image=TASK_IMAGE, job=job, timeout=60)
    try:
        sb.write_file("/workspace/a", content)
        sb.write_file("/workspace/b", content)
        first = sb.snapshot(ttl_s=1)
        second = sb.snapshot(ttl_s=1)
    finally:
        sb.release()
    assert (first.files, first.stored) == (2, len(content))  # two paths, one blob
    assert second.stored == 0
    blobs = _blobs(stack)
    assert blobs.has(sha)
    last = max(dt.datetime.fromisoformat(s.expires or "") for s in (first, second))
    wait_until(lambda: utcnow() > last, what="both snapshots expired")
    done = collect(sessions, blobs, installation=stack.installation_id, grace_s=0)
    assert done.expired >= 2
    with sessions() as session:
        states = sorted(session.scalars(select(Snapshot.state).where(Snapshot.job == job)).all())
    assert states == ["deleted", "deleted"]
    assert not blobs.has(sha)
    assert blobs.manifest(first.id) is None
    with pytest.raises(SnapshotNotFound):
        trainer.client.describe(first.id)
    report = audit(sessions, blobs, installation=stack.installation_id)
    assert report["rows_without_blobs"] == []
    assert report["manifests_without_rows"] == []
    again = collect(sessions, blobs, installation=stack.installation_id, grace_s=60)
    assert done.swept and not again.swept  # one sweep of every manifest per interval


def test_snapshot_cli_lists_and_removes(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings, cli_env: None
) -> None:
    trainer = make_trainer(owner="cli")
    job = f"snap-cli-{trainer.flavour}"
    made = CliRunner().invoke(main, ["job", "create", job, "--snapshot-bytes", "1000"])
    assert made.exit_code == 0, made.output
    sb = trainer.open(image=TASK_IMAGE, job=job, timeout=60)
    try:
        sb.write_file("/workspace/f", b"cli")
        snap = sb.snapshot()
    finally:
        sb.release()
    listed = CliRunner().invoke(main, ["snapshot", "ls", "--job", job, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["id"], r["size"]) for r in json.loads(listed.output)] == [(snap.id, 3)]
    removed = CliRunner().invoke(main, ["snapshot", "rm", snap.id])
    assert removed.exit_code == 0, removed.output
    assert _blobs(stack).manifest(snap.id) is None
    again = CliRunner().invoke(main, ["snapshot", "rm", snap.id])
    assert again.exit_code != 0 and "no such snapshot" in again.output
    with pytest.raises(SnapshotNotFound):
        trainer.client.resume(snap.id)


def test_a_tenant_snapshot_quota_spans_its_jobs_and_changes_at_run_time(
    make_trainer: Callable[..., Trainer], sessions: Any, stack: Settings, cli_env: None
) -> None:
    trainer = make_trainer(owner="tenant-bytes")
    tenant = f"bytes-{trainer.flavour}-{secrets.token_hex(3)}"
    made = CliRunner().invoke(main, ["tenant", "create", tenant, "--snapshot-bytes", "100"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["snapshot_bytes"] == 100
    jobs = [_job(sessions, f"{tenant}-{i}") for i in range(2)]
    for job in jobs:
        quotas.assign_job(sessions, job, tenant, actor="admin:test")
    first_sb = trainer.open(image=TASK_IMAGE, job=jobs[0], timeout=60)
    other_sb = trainer.open(image=TASK_IMAGE, job=jobs[1], timeout=60)
    try:
        first_sb.write_file("/workspace/a", b"a" * 60)
        first = first_sb.snapshot(ttl_s=3600)
        other_sb.write_file("/workspace/b", b"b" * 60)
        with pytest.raises(QuotaExceeded) as over:
            other_sb.snapshot()  # another job of the tenant: 60 + 60 > 100
        assert (over.value.tenant, over.value.quota) == (tenant, "snapshot_bytes")
        # room comes when ``first`` expires (an hour), not before and not never
        assert over.value.retry_after_s is not None and 0 < over.value.retry_after_s <= 3600
        other_sb.write_file("/workspace/big", b"c" * 200)
        with pytest.raises(SnapshotQuotaExceeded):
            other_sb.snapshot()  # 260 bytes alone: can never fit in 100
        other_sb.run("rm /workspace/big")
        raised = CliRunner().invoke(main, ["tenant", "set", tenant, "--snapshot-bytes", "120"])
        assert raised.exit_code == 0, raised.output
        second = other_sb.snapshot()  # the quota changed at run time
    finally:
        first_sb.release()
        other_sb.release()
    with sessions() as session:
        rows = session.execute(
            select(Snapshot.job, Snapshot.tenant, Snapshot.size_b).where(Snapshot.job.in_(jobs))
        ).all()
    assert sorted(rows) == [(jobs[0], tenant, 60), (jobs[1], tenant, 60)]
    view = quotas.get(sessions, tenant)
    assert (view.snapshot_bytes, view.snapshot_bytes_held) == (120, 120)
    listed = CliRunner().invoke(main, ["tenant", "ls"])
    assert listed.exit_code == 0 and "120/120" in listed.output, listed.output
    assert [trainer.client.describe(s.id).size for s in (first, second)] == [60, 60]


def test_another_trainers_sandbox_is_refused_and_left_alone(
    make_trainer: Callable[..., Trainer], sessions: Any
) -> None:
    owner, stranger = make_trainer(owner="owner-a"), make_trainer(owner="stranger-b")
    job = _job(sessions, f"snap-foreign-{owner.flavour}")
    sb = owner.open(image=TASK_IMAGE, job=job, timeout=60)
    try:
        sb.write_file("/workspace/mine", b"kept")
        snap = sb.snapshot()
        theirs = type(sb.target)(stranger.client.target, sb.lease, acquire_s=0.0)
        with pytest.raises(InvalidRequest, match="another trainer"):
            Handle(theirs, stranger.run).snapshot()
        with pytest.raises(InvalidRequest, match="another trainer"):
            restore = stranger.client.target._snapshot_op
            stranger._call(partial(restore, "restore", 30.0, sandbox_id=sb.id, snapshot_id=snap.id))
        assert sb.read_text("/workspace/mine") == "kept"
        assert sb.exec("true").ok  # not released by the refused restore
    finally:
        sb.release()
