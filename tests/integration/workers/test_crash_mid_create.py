"""A worker killed between a local sandbox's process start and its creator's bookkeeping
(issue 20, item 1).

Before: the meta file said ``pid: null, port: null`` until after ``Popen``; a worker that
died in between left a running sandbox (execd answering) whose row the GC's stuck-create
pass closed as ``deleted`` ("released"), whose port lock stayed taken forever, and which
``sandman audit`` never saw. Now every sandbox process carries its installation, name and
nonce on its command line, recorded before it starts: the GC finds it, deletes it on a
nonce match, confirms it gone, and frees its port; the audit counts what really runs.

The worker is real (Celery, the acquire task, the provider, bubblewrap) and dies at the
``after-sandbox-start`` failpoint (``os._exit``, like a SIGKILL at that instant). Whether a
sandbox runs is judged independently of the code under test: by the bubblewrap processes
the kernel shows whose command line binds this state dir's workspace of that pod.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from sqlalchemy import select

from broker import failpoints
from broker.backends.local import LocalBackend
from broker.client import core
from broker.client.sync import SandboxClient
from broker.ledger import store
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.names import Queue
from broker.ownership.audit import run_audit
from broker.ownership.gc import run_gc
from broker.ownership.provider import Provider
from broker.settings import Settings
from tests.integration.workers.conftest import OwnBroker
from tests.support.images import TASK_IMAGE
from tests.support.uplinks import uplinks
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
MARGIN_S = 1.0  # the creating lease: readiness budget + this; short, so the GC may act


def _running_sandboxes(state_dir: Path) -> set[str]:
    """Pod names with a live bubblewrap process of this state dir: a /proc scan of our own,
    independent of the backend (the workspace bind names the pod in every version)."""
    base = os.fsencode(str(state_dir.resolve() / "local-pods")) + b"/"
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args[0].endswith(b"bwrap"):
            continue
        for arg in args:
            if arg.startswith(base) and arg.endswith(b"/workspace"):
                found.add(os.fsdecode(arg[len(base) : -len(b"/workspace")]))
    return found


def _crash_a_create(own_broker: OwnBroker, job: str, point: str = "after-sandbox-start") -> Sandbox:
    """Run one acquire on a worker armed to die at ``point`` (right after the sandbox
    process starts, or after its uplink does); the row it left (``creating``), once its
    creating lease has run out."""
    worker = own_broker.start_worker(
        "acquire-doomed",
        Queue.ACQUIRE.value,
        env={
            "SANDMAN_FAILPOINT": point,
            "SANDMAN_CREATE_LEASE_MARGIN_S": str(MARGIN_S),
        },
    )
    client = SandboxClient(own_broker.redis_url, owner="pytest")
    try:
        client.send(*core.acquire_message(core.new_request("pytest", image=IMAGE, job=job)))
    finally:
        client.close()
    assert worker.wait(timeout=120) == failpoints.EXIT_CODE
    engine = make_engine(own_broker.database_url, pool_size=1, max_overflow=0)
    try:
        with make_session_factory(engine)() as session:
            row = session.scalars(select(Sandbox).where(Sandbox.job == job)).one()
            session.expunge(row)
    finally:
        engine.dispose()
    assert row.state == State.CREATING
    assert row.lease_expires_at is not None
    wait_until(
        lambda: dt.datetime.now(dt.UTC) > row.lease_expires_at,  # type: ignore[operator]
        timeout=60,
        what="the dead creator's lease to run out",
    )
    return row


def _provider(own_broker: OwnBroker) -> tuple[Provider, object]:
    settings: Settings = own_broker.settings
    engine = make_engine(own_broker.database_url, pool_size=2, max_overflow=0)
    sessions = make_session_factory(engine)
    return Provider(settings, sessions, LocalBackend(settings), actor="gc"), engine


def _running_in_audit(provider: Provider) -> int:
    return sum(run_audit(provider).pods_by_job.values())


def _port_locks(own_broker: OwnBroker) -> list[str]:
    locks = own_broker.settings.state_dir / "local-pods" / ".ports"
    return sorted(p.name for p in locks.iterdir()) if locks.exists() else []


@pytest.mark.parametrize("point", ["after-sandbox-start", "after-uplink-start"])
def test_gc_finds_and_removes_the_sandbox_of_a_worker_killed_mid_create(
    own_broker: OwnBroker, point: str
) -> None:
    """At either point the sandbox runs (held before execd, at the second, with its
    uplink): the GC removes all of it, uplink included (issue 20 item 5)."""
    job = own_broker.job("crashed", readiness_budget_s=5.0)
    row = _crash_a_create(own_broker, job, point)
    state = own_broker.settings.state_dir
    assert _running_sandboxes(state) == {row.pod_name}, "the orphan really runs"
    if point == "after-uplink-start":
        assert set(uplinks(state)) == {row.pod_name}, "its uplink runs too"
    provider, engine = _provider(own_broker)
    try:
        assert _running_in_audit(provider) == 1  # the audit sees what the kernel shows
        report = run_gc(provider)
        assert report.errors == []
        assert {a["why"] for a in report.actions} == {"stuck_create"}
        wait_until(lambda: not _running_sandboxes(state), timeout=60, what="the orphan gone")
        wait_until(lambda: not uplinks(state), timeout=60, what="its uplink gone")
        with provider.sessions() as session:
            closed = session.get(Sandbox, row.id)
            assert closed is not None and closed.state == State.DELETED
        assert _port_locks(own_broker) == [], "the orphan's port is free again"
        audit = run_audit(provider)
        assert audit.ok, audit.to_dict()
        assert sum(audit.pods_by_job.values()) == 0 == len(_running_sandboxes(state))
    finally:
        engine.dispose()  # type: ignore[attr-defined]


def test_audit_reports_a_sandbox_running_behind_a_closed_row_and_gc_removes_it(
    own_broker: OwnBroker,
) -> None:
    """What the old stuck-create pass produced: the row closed, the process alive. The
    audit must say NOT OK (a late sandbox), and the next GC pass must remove it."""
    job = own_broker.job("closed-early", readiness_budget_s=5.0)
    row = _crash_a_create(own_broker, job)
    state = own_broker.settings.state_dir
    provider, engine = _provider(own_broker)
    try:
        with provider.sessions.begin() as session:
            closed = store.lock_row(session, row.id)
            assert closed is not None
            store.transition(session, closed, State.RELEASING, actor="pytest")
            store.transition(session, closed, State.DELETED, actor="pytest")
        assert _running_sandboxes(state) == {row.pod_name}
        audit = run_audit(provider)
        assert not audit.ok
        assert audit.gc.late_pods == [row.pod_name]
        assert sum(audit.pods_by_job.values()) == 1
        report = run_gc(provider)
        assert report.errors == []
        wait_until(lambda: not _running_sandboxes(state), timeout=60, what="the late one gone")
        assert _port_locks(own_broker) == []
        after = run_audit(provider)
        assert after.ok, after.to_dict()
        assert sum(after.pods_by_job.values()) == 0
    finally:
        engine.dispose()  # type: ignore[attr-defined]
