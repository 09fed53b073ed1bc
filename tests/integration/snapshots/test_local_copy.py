"""The restore's local path (blobs hard-linked into the sandbox's inbox, execd copies and
verifies them) against the streamed one, at the service seam: a real execd, the real
filesystem store, the real ledger; the inbox is a host directory execd reads directly
(this execd is not sandboxed, so it sees the inbox at its host path).

Which path a restore took is read off the HTTP calls the service made (an httpx event
hook on a real client), not off timing.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.errors import SnapshotCorrupt
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.snapshots.service import Inbox, SnapshotService
from broker.snapshots.store import FsBlobStore
from tests.support.execd_daemon import Daemon

pytestmark = pytest.mark.integration


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def http() -> Iterator[list[httpx.Client]]:
    """The services' HTTP clients, closed after the test."""
    clients: list[httpx.Client] = []
    yield clients
    for client in clients:
        client.close()


def _row(sessions: Any, daemon: Daemon) -> str:
    tag = secrets.token_hex(4)
    with sessions.begin() as session:
        store.ensure_job(session, f"local-copy-{tag}")
        row = Sandbox(
            job=f"local-copy-{tag}",
            installation="local-copy-test",
            nonce=secrets.token_hex(16),
            pod_name=f"local-copy-{tag}",
            namespace="test",
            backend="local",
            image="localhost/test:v1",
            image_resolved="sha256:" + "0" * 64,
            cpu_m=100,
            memory_b=1 << 20,
            state=State.READY,
            address=f"127.0.0.1:{daemon.port}",
        )
        session.add(row)
        session.flush()
        return row.id


def _service(
    sessions: Any,
    daemon: Daemon,
    blobs: FsBlobStore,
    inbox: Callable[[Sandbox], Inbox | None],
    clients: list[httpx.Client],
) -> tuple[SnapshotService, list[str]]:
    calls: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda req: calls.append(req.url.path)]})
    clients.append(http)
    service = SnapshotService(
        sessions,
        blobs,
        lambda row: daemon.token,
        installation="local-copy-test",
        http=http,
        inbox_for=inbox,
    )
    return service, calls


def _captured(service: SnapshotService, sandbox_id: str, work: Path) -> tuple[str, bytes]:
    """A tree with a big file, a duplicate and a mode; captured, then all deleted."""
    big = os.urandom(3 << 20)
    (work / "deep").mkdir()
    (work / "deep" / "big.bin").write_bytes(big)
    (work / "a.py").write_bytes(b"print(1)\n")
    (work / "b.py").write_bytes(b"print(1)\n")
    os.chmod(work / "a.py", 0o640)
    snap = service.capture(sandbox_id)
    for name in ("deep/big.bin", "a.py", "b.py"):
        (work / name).unlink()
    return snap["id"], big


def test_a_restore_copies_from_the_inbox_and_empties_it(
    sessions: Any, daemon: Daemon, tmp_path: Path, http: list[httpx.Client]
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    service, calls = _service(
        sessions, daemon, FsBlobStore(tmp_path / "store"), lambda row: (inbox, str(inbox)), http
    )
    sandbox_id = _row(sessions, daemon)
    snap_id, big = _captured(service, sandbox_id, daemon.workdir)
    calls.clear()
    done = service.restore(sandbox_id, snap_id)
    assert done["written"] == 3
    assert [p for p in calls if p.startswith("/v1/snapshot/")] == [
        "/v1/snapshot/prepare", "/v1/snapshot/copy", "/v1/snapshot/finish",
    ]  # fmt: skip
    assert (daemon.workdir / "deep" / "big.bin").read_bytes() == big
    assert (daemon.workdir / "b.py").read_bytes() == b"print(1)\n"
    assert oct(os.stat(daemon.workdir / "a.py").st_mode & 0o7777) == oct(0o640)
    assert list(inbox.iterdir()) == []  # the hard links go with the restore


def test_a_corrupted_blob_is_detected_on_the_local_path(
    sessions: Any, daemon: Daemon, tmp_path: Path, http: list[httpx.Client]
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    blobs = FsBlobStore(tmp_path / "store")
    service, calls = _service(sessions, daemon, blobs, lambda row: (inbox, str(inbox)), http)
    sandbox_id = _row(sessions, daemon)
    snap_id, big = _captured(service, sandbox_id, daemon.workdir)
    blobs.local_path(hashlib.sha256(big).hexdigest()).write_bytes(b"X" + big[1:])
    with pytest.raises(SnapshotCorrupt, match="blob_mismatch"):
        service.restore(sandbox_id, snap_id)
    assert "/v1/snapshot/copy" in calls
    assert not (daemon.workdir / "deep" / "big.bin").exists()
    assert list(inbox.iterdir()) == []


def test_without_an_inbox_or_across_filesystems_the_blobs_are_streamed(
    sessions: Any, daemon: Daemon, tmp_path: Path, http: list[httpx.Client]
) -> None:
    blobs = FsBlobStore(tmp_path / "store")
    sandbox_id = _row(sessions, daemon)
    elsewhere = Path("/dev/shm")  # a tmpfs: a hard link from the store fails (EXDEV)
    if not elsewhere.is_dir() or elsewhere.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to put the inbox on")
    shm = elsewhere / f"sandman-inbox-{secrets.token_hex(4)}"
    shm.mkdir()
    try:
        for inbox in (None, (shm, str(shm))):
            service, calls = _service(sessions, daemon, blobs, lambda row, box=inbox: box, http)
            snap_id, big = _captured(service, sandbox_id, daemon.workdir)
            calls.clear()
            assert service.restore(sandbox_id, snap_id)["written"] == 3
            assert "/v1/snapshot/put" in calls and "/v1/snapshot/copy" not in calls
            assert (daemon.workdir / "deep" / "big.bin").read_bytes() == big
            (daemon.workdir / "deep" / "big.bin").unlink()
            (daemon.workdir / "deep").rmdir()
        assert list(shm.iterdir()) == []
    finally:
        for left in shm.iterdir():
            left.unlink()
        shm.rmdir()
