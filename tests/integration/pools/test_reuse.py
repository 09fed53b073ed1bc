"""Checked reuse, accepted and rejected, through the broker service (real PostgreSQL and
Redis, local bubblewrap sandboxes). The execd here is a small stand-in at the HTTP seam
whose state check answers from a marker file, so each verdict can be forced.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from broker.acquire.service import Broker
from broker.backends.local import LocalBackend
from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import State
from broker.pools.store import pool_key
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from broker.wire.types import Lease
from tests.support.images import SWE_IMAGE

pytestmark = pytest.mark.integration

FAKE_EXECD = r"""
import argparse, json, os, socket, subprocess
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
p = argparse.ArgumentParser(); p.add_argument("--listen"); p.add_argument("--listen-fd", type=int)
p.add_argument("--workdir"); a = p.parse_args()
fd = os.environ.get("SANDMAN_EXECD_TOKEN_FD")  # how the local backend hands the token over
TOKEN = os.fdopen(int(fd)).read().strip() if fd else os.environ["SANDMAN_EXECD_TOKEN"]
MARK = os.path.join(a.workdir, "DIRTY")
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *x): pass
    def send(self, code, obj):
        b = json.dumps(obj).encode(); self.send_response(code)
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self): self.send(200, {"ok": True})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.headers.get("Authorization") != "Bearer " + TOKEN:
            return self.send(401, {"error": {"code": "unauthorized", "message": "no"}})
        dirty = open(MARK).read() if os.path.exists(MARK) else None
        if self.path == "/v1/exec":
            r = subprocess.run(["bash", "-c", body["command"]], capture_output=True, text=True,
                               cwd=a.workdir)
            return self.send(200, {"exit_code": r.returncode, "stdout": r.stdout,
                                   "stderr": r.stderr})
        if self.path == "/v1/state-check":
            return self.send(200, {"clean": dirty is None, "restorable": dirty == "restorable",
                                   "differences": [] if dirty is None else ["DIRTY"]})
        if self.path == "/v1/restore":
            if dirty == "restorable":
                os.unlink(MARK)
            return self.send(200, {"clean": not os.path.exists(MARK)})
        self.send(200, {"clean": True})
if a.listen_fd is not None:  # the local backend binds on the host and hands the socket down
    server = ThreadingHTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
    server.socket.close()
    server.socket = socket.socket(fileno=a.listen_fd)
else:
    host, port = a.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), H)
server.serve_forever()
"""


@pytest.fixture
def broker(database_url: str, redis_url: str, sessions: Any, tmp_path: Path) -> Iterator[Broker]:
    execd = tmp_path / "fake" / "execd"
    execd.mkdir(parents=True)
    (execd / "__init__.py").write_text("")
    (execd / "__main__.py").write_text(FAKE_EXECD)
    url = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(url)
    client.flushdb()
    settings = Settings(
        state_dir=tmp_path / "state",
        database_url=database_url,
        redis_url=url,
        secret_key=secrets.token_hex(16),
        installation_id="t-reuse",
        max_reuses=8,
    )
    backend = LocalBackend(settings, execd_dir=execd)
    svc = Broker(settings, sessions, backend, client, enqueue=lambda *a: None)
    with sessions.begin() as session:
        store.ensure_job(session, "grading", reuse=True, max_reuses=2)
    yield svc
    with sessions() as session:
        live = session.scalars(
            select(Sandbox.id).where(Sandbox.job == "grading", Sandbox.state == State.READY)
        ).all()
    for sandbox_id in live:
        svc.provider.release(sandbox_id, reason="test-teardown")
    client.close()


def _request() -> AcquireRequest:
    return AcquireRequest.new(
        job="grading", image=SWE_IMAGE, cpu="500m", memory=256 << 20, role="grading"
    )


def _acquire(broker: Broker) -> Lease:
    """What the trainer's client does: the warm pool first (a reused pod is published
    there), then a cold acquire through the service."""
    request = _request()
    key = pool_key(request.image, None, None, request.cpu_m, request.memory_b)
    lease = broker.warm.claim(request.job, key, request.request_id)
    if lease is None:
        return broker.acquire(request)
    broker.claimed(lease.sandbox_id, request.request_id, None, None, request.enqueued_utc)
    return lease


def _exec(address: str, token: str, command: str) -> None:
    import httpx

    httpx.post(
        f"http://{address}/v1/exec",
        json={"command": command},
        headers={"Authorization": f"Bearer {token}"},
    ).raise_for_status()


def _decisions(sessions: Any, sandbox_id: str) -> list[tuple[str, str | None]]:
    with sessions() as session:
        return [
            (e.action, e.outcome)
            for e in session.scalars(
                select(Event)
                .where(Event.sandbox_id == sandbox_id, Event.kind == "reuse")
                .order_by(Event.id)
            )
        ]


def test_clean_and_restorable_pods_are_reused_up_to_the_limit(
    broker: Broker, sessions: Any
) -> None:
    first = _acquire(broker)
    assert broker.release(first.sandbox_id) == "reused"
    with sessions() as session:
        row = session.get(Sandbox, first.sandbox_id)
        assert row is not None and row.state == State.READY and row.reuse_count == 1
        assert row.owner is None and row.pool_key is not None
    second = _acquire(broker)  # a compatible request gets the checked pod
    assert second.sandbox_id == first.sandbox_id and second.reused
    _exec(second.address, second.token, "printf restorable > DIRTY")
    assert broker.release(second.sandbox_id) == "reused"  # restored, then clean
    third = _acquire(broker)
    assert third.sandbox_id == first.sandbox_id
    assert broker.release(third.sandbox_id) == "released"  # max_reuses=2 reached
    with sessions() as session:
        row = session.get(Sandbox, first.sandbox_id)
        assert row is not None and row.state == State.DELETED and row.reuse_count == 2
    assert _decisions(sessions, first.sandbox_id) == [
        ("accept", "clean"),
        ("accept", "clean"),
        ("reject", "reuse-limit"),
    ]


def test_dirty_pods_are_deleted_not_reused(broker: Broker, sessions: Any) -> None:
    lease = _acquire(broker)
    _exec(lease.address, lease.token, "printf poisoned > DIRTY")
    assert broker.release(lease.sandbox_id) == "released"
    with sessions() as session:
        row = session.get(Sandbox, lease.sandbox_id)
        assert row is not None and row.state == State.DELETED and row.reuse_count == 0
    assert _decisions(sessions, lease.sandbox_id) == [("reject", "dirty")]
    # The next request gets a fresh pod, never the poisoned one.
    fresh = _acquire(broker)
    assert fresh.sandbox_id != lease.sandbox_id
    broker.release(fresh.sandbox_id, reason="done")
