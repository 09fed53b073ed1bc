"""Snapshots, fork, pause and resume on the local cluster (the local-backend tests are in
tests/integration/snapshots; these are the same checks with sandboxes as pods).

A broker of its own (embedded PostgreSQL and Redis, tests.support.ownbroker) whose Celery
workers run with the Kubernetes backend: every sandbox is a pod on the real node, every
tag is resolved to a digest through the cluster's loopback registry, and the workers
(on this host) reach each pod's execd at its pod IP. The blob store is the workers' (the
state dir's filesystem), which the tests read and, to corrupt a blob, write behind the
broker's back.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from broker.backends.factory import make_backend
from broker.client.sync import Sandbox, SandboxClient
from broker.errors import InvalidRequest, SandmanError, SnapshotCorrupt, SnapshotNotFound
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Sandbox as SandboxRow
from broker.ledger.models import Snapshot as SnapshotRow
from broker.ledger.models import utcnow
from broker.ledger.states import State
from broker.names import Queue
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.snapshots.store import FsBlobStore, default_store
from broker.wire.snapshots import Snapshot
from tests.cluster.conftest import (
    REAL_NODE_SELECTOR,
    SWE_TASK_IMAGE,
    TASK_BASE_IMAGE,
    fresh_namespace,
    image_tarball,
)
from tests.integration.client.test_transports import Handle
from tests.integration.snapshots.test_fork import _change_everything, _out, check_forks
from tests.support.forkcrash import KUBE_POINTS, kill_mid_fork
from tests.support.ownbroker import OwnBroker, own_settings, running_broker
from tests.support.registry import LoopbackRegistry
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster

JOB_CONFIG: dict[str, Any] = {"node_selector": REAL_NODE_SELECTOR, "readiness_budget_s": 180.0}
OPEN = {"cpu": 0.25, "memory": "256Mi", "timeout": 180.0}  # three pods fit the real node
RESTORE_TIMEOUT_S = 90.0  # the crash tests' trainer waits this long for a dead restore


def kube_settings(state_dir: Any, kubeconfig: str, namespace: str, registries: str) -> Settings:
    return own_settings(
        state_dir,
        backend="kubernetes",
        kubeconfig=kubeconfig,
        namespace=namespace,
        registries=registries,
        readiness_budget_s=180.0,
    )


@pytest.fixture(scope="module")
def kube_broker(
    kubeconfig_path: str, core_v1: Any, registry_setting: str, tmp_path_factory: Any
) -> Iterator[OwnBroker]:
    """One worker serving acquires (and so captures and restores), releases and pools."""
    with fresh_namespace(core_v1, "snapshots") as namespace:
        state_dir = tmp_path_factory.mktemp("kube-broker")
        settings = kube_settings(state_dir, kubeconfig_path, namespace, registry_setting)
        with running_broker(settings) as broker:
            broker.start_worker("worker", f"{Queue.ACQUIRE},{Queue.RELEASE},{Queue.POOL}", 16)
            yield broker


@pytest.fixture(scope="module")
def client(kube_broker: OwnBroker) -> Iterator[SandboxClient]:
    c = SandboxClient(kube_broker.redis_url, owner="snapshots-cluster")
    yield c
    c.close()


@pytest.fixture(scope="module")
def ledger(kube_broker: OwnBroker) -> Iterator[Any]:
    engine = make_engine(kube_broker.database_url, pool_size=2, max_overflow=0)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def job(kube_broker: OwnBroker) -> str:
    """A job of its own for each test, its sandboxes on the real node."""
    return kube_broker.job(f"snap-{secrets.token_hex(3)}", **JOB_CONFIG)


def _h(sb: Sandbox) -> Handle:
    """The integration tests' helpers take a Handle; a sync sandbox needs no event loop."""
    return Handle(sb, lambda out: out)


def _live_sandboxes(ledger: Any, job: str) -> list[str]:
    with ledger() as session:
        return sorted(
            session.scalars(
                select(SandboxRow.id).where(
                    SandboxRow.job == job, SandboxRow.state != State.DELETED
                )
            )
        )


def _pods_of(broker: OwnBroker, job: str) -> list[str]:
    backend = make_backend(broker.settings, ensure_namespace=False)
    try:
        pods = backend.list_installation(broker.settings.namespace, broker.settings.installation_id)
        return sorted(p.name for p in pods if p.labels.get("sandman.io/job") == job)
    finally:
        backend.close()


def _all_released(broker: OwnBroker, ledger: Any, job: str) -> None:
    """No live row of ``job`` and no pod of it left on the cluster."""
    wait_until(lambda: not _live_sandboxes(ledger, job), 180, what=f"{job}: rows released")
    wait_until(lambda: not _pods_of(broker, job), 180, what=f"{job}: pods deleted")


def _snapshot_of(
    client: SandboxClient,
    job: str,
    files: dict[str, bytes],
    image: str = TASK_BASE_IMAGE,
    **options: Any,
) -> Snapshot:
    """A snapshot of a fresh pod of ``image`` holding ``files``; the pod is released."""
    sb = client.open(image=image, job=job, **OPEN)
    try:
        for path, content in files.items():
            sb.write_file(path, content)
        return sb.snapshot(**options)
    finally:
        sb.release()


def _store(broker: OwnBroker) -> FsBlobStore:
    return default_store(broker.settings.state_dir)


def test_fork_carries_every_change_and_forks_are_independent(
    kube_broker: OwnBroker, client: SandboxClient, ledger: Any, job: str
) -> None:
    sb = client.open(image=SWE_TASK_IMAGE, job=job, workdir="/repo", **OPEN)
    forks: list[Any] = []
    try:
        victim = _change_everything(_h(sb))
        forks = sb.fork(2)
        assert all(not isinstance(f, SandmanError) for f in forks), forks
        assert len({sb.lease.pod_name, *(f.lease.pod_name for f in forks)}) == 3
        check_forks(_h(sb), [_h(f) for f in forks], victim)
        for fork in forks:  # each pod keeps its own name; the exports are the source's
            assert _out(_h(fork), 'echo "$HOSTNAME"') == f"{fork.lease.pod_name}\n"
    finally:
        for fork in forks:
            if not isinstance(fork, SandmanError):
                fork.release()
        sb.release()
    _all_released(kube_broker, ledger, job)


def test_a_corrupted_blob_fails_the_restore_and_releases_its_pod(
    kube_broker: OwnBroker, client: SandboxClient, ledger: Any, job: str
) -> None:
    content = b"the only copy of this content, on a pod\n"
    snap = _snapshot_of(client, job, {"/workspace/data.bin": content})
    _all_released(kube_broker, ledger, job)
    blob = _store(kube_broker)._blob(hashlib.sha256(content).hexdigest())
    blob.write_bytes(b"X" + content[1:])  # same size, other bytes
    with pytest.raises(SnapshotCorrupt, match="blob_mismatch"):
        client.resume(snap.id, **OPEN)
    _all_released(kube_broker, ledger, job)  # the pod it went into is gone too


def test_an_expired_snapshot_is_collected(
    kube_broker: OwnBroker, client: SandboxClient, ledger: Any, job: str
) -> None:
    content = b"collected once expired, on a pod\n"
    sha = hashlib.sha256(content).hexdigest()
    snap = _snapshot_of(client, job, {"/workspace/a": content}, ttl_s=1)
    store = _store(kube_broker)
    assert store.has(sha) and store.manifest(snap.id) is not None
    expires = dt.datetime.fromisoformat(snap.expires or "")
    wait_until(lambda: utcnow() > expires, what="the snapshot expired")
    settings = dataclasses.replace(kube_broker.settings, snapshot_grace_s=0.0)
    backend = make_backend(settings, ensure_namespace=False)
    try:
        report = run_gc(Provider(settings, ledger, backend, actor="gc"))
    finally:
        backend.close()
    assert report.errors == [] and report.snapshots["expired"] >= 1, report
    with ledger() as session:
        assert session.get(SnapshotRow, snap.id).state == "deleted"
    assert not store.has(sha) and store.manifest(snap.id) is None
    with pytest.raises(SnapshotNotFound):
        client.describe(snap.id)


def test_pause_releases_the_pod_and_resume_continues_in_a_new_one(
    kube_broker: OwnBroker, client: SandboxClient, ledger: Any, job: str
) -> None:
    sb = client.open(image=TASK_BASE_IMAGE, job=job, **OPEN)
    try:
        sb.write_file("/workspace/notes/todo.txt", "resume me\n", mode=0o600)
        _out(_h(sb), "cd /workspace/notes && export PAUSED='at step 3'")
        snap = sb.pause()
    except BaseException:
        sb.release()
        raise
    assert snap.image_digest and snap.image_digest.startswith("sha256:"), snap
    wait_until(lambda: not _live_sandboxes(ledger, job), 180, what="the paused pod released")
    again = client.resume(snap.id, **OPEN)
    try:
        assert again.id != sb.id and again.lease.pod_name != sb.lease.pod_name
        assert again.read_text("/workspace/notes/todo.txt") == "resume me\n"
        assert _out(_h(again), 'stat -c %a todo.txt; pwd; echo "$PAUSED"') == (
            "600\n/workspace/notes\nat step 3\n"
        )
    finally:
        again.release()
    _all_released(kube_broker, ledger, job)


def test_a_restore_into_a_pod_of_another_image_digest_is_refused(
    kube_broker: OwnBroker, client: SandboxClient, ledger: Any, job: str, registry_setting: str
) -> None:
    """One repository, two digests (the task base, the SWE image): a snapshot of a pod of
    the first is refused by a pod of the same reference pinned to the second."""
    registry = LoopbackRegistry.running_at(registry_setting.split("=", 1)[1])
    repository = f"sandman-snapdigest-{secrets.token_hex(3)}"
    digest = registry.push(image_tarball(TASK_BASE_IMAGE), f"{repository}:v1")
    other = registry.push(image_tarball(SWE_TASK_IMAGE), f"{repository}:other")
    image = f"localhost/{repository}:v1"
    snap = _snapshot_of(client, job, {"/workspace/mine": b"base image state"}, image)
    assert (snap.image, snap.image_digest) == (image, digest)
    with pytest.raises(InvalidRequest, match=re.escape(f"the sandbox runs {image}@{other}")):
        client.resume(snap.id, **OPEN, image_digest=other)
    _all_released(kube_broker, ledger, job)  # the refused pod was released, untouched
    with ledger() as session:
        assert session.get(SnapshotRow, snap.id).state == "ready"  # still usable
    again = client.resume(snap.id, **OPEN)
    try:
        assert again.read_text("/workspace/mine") == "base image state"
    finally:
        again.release()


@pytest.mark.parametrize("point", KUBE_POINTS)
def test_a_worker_killed_mid_fork_leaves_nothing_unowned(
    point: str,
    kubeconfig_path: str,
    namespace: str,
    registry_setting: str,
    tmp_path_factory: Any,
) -> None:
    state_dir = tmp_path_factory.mktemp("kube-crash")
    settings = kube_settings(state_dir, kubeconfig_path, namespace, registry_setting)
    with running_broker(settings) as broker:
        kill_mid_fork(
            broker,
            point,
            spec={**OPEN, "image": TASK_BASE_IMAGE, "timeout": RESTORE_TIMEOUT_S},
            job_config=JOB_CONFIG,
        )
