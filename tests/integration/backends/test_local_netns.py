"""Local sandboxes in network namespaces of their own (issue 20 item 5), end to end.

Real bubblewrap, the real execd, the real slirp4netns and iptables. What a sandbox can
reach is judged from inside it, with bash's /dev/tcp (no client of ours in the image),
against listeners this test owns: one on the host's loopback, and a "remote" server in a
network namespace the test creates (``ip netns`` + a veth pair on an address range no
one else uses here), torn down at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from broker.backends import localprocs
from broker.backends.local import LocalBackend
from broker.errors import GuardMissing
from broker.settings import Settings
from broker.wire.execd import execd_answers
from tests.support.factories import pod_spec
from tests.support.uplinks import uplinks
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
TOKEN = "t" * 32
SLIRP_HOST = "10.0.2.2"  # slirp4netns's address of the host (its loopback, unless disabled)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    for tool in ("bwrap", "slirp4netns", "iptables-restore", "ip"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required: bash deploy/host-deps.sh")
    made = LocalBackend(Settings(state_dir=tmp_path / "state"))
    yield made
    for proc in localprocs.scan(made.mark_root):  # whatever a failed test left running
        made.delete(proc.namespace, proc.name, proc.nonce)


class HostListener:
    """A TCP listener on the host's 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.fixture
def host_listener() -> Iterator[HostListener]:
    listener = HostListener()
    yield listener
    listener.sock.close()


@dataclass(frozen=True)
class Remote:
    """A server outside every sandbox: in its own netns, at two addresses."""

    allowed: str  # the address an allow-list names
    other: str  # the same server at an address the allow-list does not name
    port: int


@pytest.fixture
def remote() -> Iterator[Remote]:
    """``ip netns`` + veth: host side 10.199.N.1/24, far side .2 and .3, where a tiny
    server answers ``pong`` on every connection. N from our pid, so that two runs on one
    machine do not collide; everything goes with the namespace in the finalizer."""
    tag = os.getpid() % 100000
    ns, host_if, far_if = f"smt-{tag}", f"smh{tag}", f"smf{tag}"
    net = f"10.199.{tag % 250}"
    port = 18080

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", ns)
    server = None
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", far_if, "netns", ns)
        ip("addr", "add", f"{net}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        for addr in (f"{net}.2/24", f"{net}.3/24"):
            ip("-n", ns, "addr", "add", addr, "dev", far_if)
        ip("-n", ns, "link", "set", far_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        code = (
            "import socket\n"
            f"s = socket.create_server(('0.0.0.0', {port}))\n"
            "print('up', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept(); c.sendall(b'pong'); c.close()\n"
        )
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code],
            stdout=subprocess.PIPE,
        )
        assert server.stdout is not None and server.stdout.readline() == b"up\n"
        with socket.create_connection((f"{net}.2", port), timeout=5) as probe:
            assert probe.recv(4) == b"pong", "the host reaches the remote server"
        yield Remote(allowed=f"{net}.2", other=f"{net}.3", port=port)
    finally:
        if server is not None:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)


def _start(backend: LocalBackend, name: str, **fields: object) -> str:
    """Create sandbox ``name`` and return its execd address once it answers."""
    spec = pod_spec(name, nonce=f"n-{name}", **fields)
    backend.create(spec)
    for info in backend.watch_ready("ns", {name}, 30):
        assert info.ready and info.address, info
        return info.address
    raise AssertionError(f"{name} never became ready")


def _reach(address: str, host: str, port: int) -> str:
    """From inside the sandbox at ``address``: connect to host:port and read what the
    server says. 'refused' or 'unreachable' (with the reason) when it cannot connect."""
    command = (
        f"if exec 3<>/dev/tcp/{host}/{port}; then "
        "echo connected; head -c 4 <&3; echo; else echo unreachable; fi"
    )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"http://{address}", headers=headers, timeout=60) as http:
        out = http.post("/v1/exec", json={"command": command, "timeout": 20}).json()
    if out.get("timed_out"):
        return "timed out"
    return str(out["stdout"]).strip() or str(out["stderr"]).strip()


def test_a_sandbox_reaches_no_other_sandbox_and_no_host_loopback(
    backend: LocalBackend, host_listener: HostListener
) -> None:
    """Sandbox A (egress allowed, so with an uplink) tries sandbox B's execd port and a
    host loopback listener, directly and through the uplink's host address: nothing
    connects, the listener accepts nothing; the trainer still reaches both execds."""
    a = _start(backend, "sm-net-a")
    b = _start(backend, "sm-net-b")
    b_port = int(b.rsplit(":", 1)[1])
    for host, port in [
        ("127.0.0.1", b_port),
        ("127.0.0.1", host_listener.port),
        (SLIRP_HOST, b_port),
        (SLIRP_HOST, host_listener.port),
    ]:
        assert not _reach(a, host, port).startswith("connected"), (host, port)
    assert host_listener.accepted == 0
    assert execd_answers(a, TOKEN) and execd_answers(b, TOKEN), "the trainer reaches both"
    with socket.create_connection(("127.0.0.1", host_listener.port)):
        pass  # the listener itself works: the host reaches it
    wait_until(lambda: host_listener.accepted == 1, 10, 0.02, "the host's own connection")


def test_egress_deny_allow_and_allow_list(
    backend: LocalBackend, remote: Remote, host_listener: HostListener
) -> None:
    """deny: no route out at all; allow: the remote server answers, the host's loopback
    still does not; an allow-list: only the listed network answers."""
    backend.ensure_egress_guard("ns", "denied", [])
    backend.ensure_egress_guard("ns", "listed", [f"{remote.allowed}/32"])
    assert backend.has_egress_guard("ns", "denied") and backend.has_egress_guard("ns", "listed")
    open_ = _start(backend, "sm-eg-open")
    denied = _start(backend, "sm-eg-deny", job="denied", egress_denied=True)
    listed = _start(backend, "sm-eg-list", job="listed", egress_denied=True)

    assert _reach(open_, remote.allowed, remote.port) == "connected\npong"
    assert _reach(open_, remote.other, remote.port) == "connected\npong"
    assert not _reach(open_, SLIRP_HOST, host_listener.port).startswith("connected")

    assert not _reach(denied, remote.allowed, remote.port).startswith("connected")
    assert not _reach(denied, remote.other, remote.port).startswith("connected")

    assert _reach(listed, remote.allowed, remote.port) == "connected\npong"
    assert not _reach(listed, remote.other, remote.port).startswith("connected")
    assert not _reach(listed, SLIRP_HOST, host_listener.port).startswith("connected")
    assert host_listener.accepted == 0


def test_egress_guard_refuses_what_it_cannot_enforce(backend: LocalBackend) -> None:
    assert backend.has_egress_guard("ns", "j") is False
    with pytest.raises(GuardMissing):
        backend.ensure_egress_guard("ns", "j", ["not-a-cidr"])
    with pytest.raises(GuardMissing):
        backend.ensure_egress_guard("ns", "j", ["2001:db8::/32"])
    assert backend.has_egress_guard("ns", "j") is False
    backend.ensure_egress_guard("ns", "j", [])
    assert backend.has_egress_guard("ns", "j") is True


def test_a_denied_sandbox_without_its_guard_gets_no_egress(
    backend: LocalBackend, remote: Remote
) -> None:
    """Fail closed: a denied sandbox whose job has no guard file gets no uplink at all."""
    address = _start(backend, "sm-eg-noguard", job="unguarded", egress_denied=True)
    assert not _reach(address, remote.allowed, remote.port).startswith("connected")
    assert [p.name for p in localprocs.scan(backend.mark_root)].count("sm-eg-noguard") == 2


def _uplinks(backend: LocalBackend, name: str) -> list[int]:
    return uplinks(backend.root.parent).get(name, [])


def test_the_uplink_is_marked_and_dies_with_its_sandbox_whoever_kills_it(
    backend: LocalBackend,
) -> None:
    """The uplink is listed with its sandbox's name and nonce; when the sandbox's processes
    are SIGKILLed by someone else (not our delete), the uplink exits by itself."""
    import signal

    _start(backend, "sm-up-1")
    helpers = _uplinks(backend, "sm-up-1")
    assert len(helpers) == 1, "one slirp4netns per sandbox with egress"
    scanned = {p.pid: (p.name, p.nonce) for p in localprocs.scan(backend.mark_root)}
    assert scanned[helpers[0]] == ("sm-up-1", "n-sm-up-1")
    meta = backend._load("sm-up-1")
    assert meta is not None
    os.killpg(int(meta["pid"]), signal.SIGKILL)  # the sandbox only, not the uplink
    wait_until(lambda: not _uplinks(backend, "sm-up-1"), 30, 0.05, "the uplink to exit")
    assert backend.delete("ns", "sm-up-1", "n-sm-up-1")

    _start(backend, "sm-up-2")
    assert len(_uplinks(backend, "sm-up-2")) == 1
    assert backend.delete("ns", "sm-up-2", "n-sm-up-2")
    assert _uplinks(backend, "sm-up-2") == [], "the delete kills the uplink, confirmed"
