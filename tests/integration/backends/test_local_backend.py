"""The local backend end to end: bubblewrap + the real execd, no broker around it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.backends.local import LocalBackend, _children, _proc_start
from broker.errors import KubeConflict, KubeUnavailable
from broker.settings import Settings
from broker.wire.execd import execd_answers
from tests.support.factories import pod_spec
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required: apt-get install -y bubblewrap")
    return LocalBackend(Settings(state_dir=tmp_path / "state"))


def _ready(backend: LocalBackend, name: str) -> str:
    for info in backend.watch_ready("ns", {name}, 20):
        assert info.ready, info
        assert info.address
        return info.address
    raise AssertionError("never ready")


def test_create_exec_files_delete(backend: LocalBackend) -> None:
    spec = pod_spec("sm-life")
    backend.create(spec)
    address = _ready(backend, "sm-life")
    assert execd_answers(address, spec.token)
    assert not execd_answers(address, "wrong-token")
    headers = {"Authorization": f"Bearer {spec.token}"}
    with httpx.Client(base_url=f"http://{address}", headers=headers) as http:
        out = http.post(
            "/v1/exec", json={"command": "echo $$; id -u; ls /root | wc -l; pwd", "timeout": 10}
        ).json()
        lines = out["stdout"].split()
        assert out["exit_code"] == 0
        assert lines[2] == "0", "the host's home (and its secrets) must be hidden"
        assert lines[3] == "/workspace"
        write = http.post(
            "/v1/files/write", json={"path": "/workspace/a.txt", "content_b64": "aGVsbG8="}
        )
        assert write.status_code == 200
        layer = http.post("/v1/exec", json={"command": "touch /usr/x", "timeout": 10}).json()
        assert layer["exit_code"] == 0, "the sandbox writes its own layer over the image"
        image_root = backend.images.rootfs(backend.images.resolve(spec.image))
        assert not (image_root / "usr/x").exists(), "the shared image root is never written"
    meta = backend._load("sm-life")
    assert meta is not None
    pids = [int(meta["pid"]), int(meta["child_pid"])]
    assert backend.delete("ns", "sm-life", "someone-else") is False
    assert backend.get("ns", "sm-life") is not None
    assert backend.delete("ns", "sm-life", spec.nonce) is True
    assert backend.get("ns", "sm-life") is None
    time.sleep(0.2)
    assert all(_proc_start(p) is None for p in pids), "every sandbox process is gone"


def test_pods_are_found_again_after_a_restart(backend: LocalBackend, tmp_path: Path) -> None:
    spec = pod_spec("sm-restart", nonce="n-2")
    backend.create(spec)
    _ready(backend, "sm-restart")
    with pytest.raises(KubeConflict):
        backend.create(spec)
    again = LocalBackend(Settings(state_dir=tmp_path / "state"))  # a new broker process
    listed = again.list_installation("ns", "inst-test")
    assert [p.name for p in listed] == ["sm-restart"]
    assert listed[0].nonce == "n-2"
    info = again.get("ns", "sm-restart")
    assert info is not None and info.ready
    # The sandbox runs in its own session, so it does not die with its creator.
    meta = again._load("sm-restart")
    assert meta is not None and os.getsid(int(meta["pid"])) != os.getsid(0)
    assert again.delete("ns", "sm-restart", "n-2")
    assert again.list_all_labelled("ns") == []


def _zombies_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and fields.get("State", "").startswith("Z"):
            out.append(int(status.parent.name))
    return out


def test_creator_reaps_sandboxes_deleted_by_another_process(backend: LocalBackend) -> None:
    """The acquire worker creates, the control worker deletes: the creator must still reap.

    Another process's delete is a SIGKILL this process never waits for; stand in for it
    by killing the sandbox's process group directly."""
    import signal

    first = backend.create(pod_spec("sm-reap-1"))
    _ready(backend, "sm-reap-1")
    meta = backend._load("sm-reap-1")
    assert meta is not None and meta["pid"] in _children
    os.killpg(int(meta["pid"]), signal.SIGKILL)
    wait_until(
        lambda: int(meta["pid"]) in _zombies_of(os.getpid()),
        10,
        0.05,
        "the killed sandbox to become our zombie",
    )
    backend.create(pod_spec("sm-reap-2", nonce="n-2"))  # any later create sweeps
    assert int(meta["pid"]) not in _children
    assert int(meta["pid"]) not in _zombies_of(os.getpid())
    assert first.name == "sm-reap-1"
    backend.delete("ns", "sm-reap-2", "n-2")
    backend.delete("ns", "sm-reap-1", "n-1")


def test_ports_come_from_a_claimed_range_outside_the_ephemeral_one(
    backend: LocalBackend,
) -> None:
    from broker.backends.localports import PORT_RANGE

    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert PORT_RANGE[1] <= low or PORT_RANGE[0] > high  # no outgoing connection can take one
    names = ["sm-port-1", "sm-port-2"]
    for i, name in enumerate(names):
        backend.create(pod_spec(name, nonce=f"n-{i}"))
    ports = [int(backend._load(n)["port"]) for n in names]  # type: ignore[index]
    assert len(set(ports)) == 2 and all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)
    locks = backend.root / ".ports"
    assert {int(p.name) for p in locks.iterdir()} >= set(ports)
    for name in names:
        _ready(backend, name)
    for i, name in enumerate(names):
        backend.delete("ns", name, f"n-{i}")
    assert not {int(p.name) for p in locks.iterdir()} & set(ports)
    assert not any((backend.root / ".locks").iterdir()), "no record lock outlives its sandbox"


def test_a_sandbox_is_found_by_its_marker_alone_and_deleted_by_nonce(
    backend: LocalBackend,
) -> None:
    """A running sandbox whose record is gone (the state a crashed old-style delete or
    GC left) is still listed, with the nonce from its command line; a delete with another
    nonce leaves it, the right nonce kills it, confirmed, and frees its port."""
    from broker.backends import localprocs

    spec = pod_spec("sm-marked", nonce="n-marked")
    backend.create(spec)
    address = _ready(backend, "sm-marked")
    headers = {"Authorization": f"Bearer {spec.token}"}
    with httpx.Client(base_url=f"http://{address}", headers=headers) as http:
        env = http.post("/v1/exec", json={"command": "env", "timeout": 10}).json()["stdout"]
    assert localprocs.MARK_ENV not in env, "the marker is on bwrap's argv, not in the env"
    port = int(backend._load("sm-marked")["port"])  # type: ignore[index]
    backend._meta_path("sm-marked").unlink()
    listed = LocalBackend(Settings(state_dir=backend.root.parent)).list_all_labelled("ns")
    assert [(p.name, p.nonce, p.phase) for p in listed] == [("sm-marked", "n-marked", "Running")]
    assert backend.delete("ns", "sm-marked", "n-other") is False
    assert [p.name for p in localprocs.scan(backend.mark_root)] != []
    assert backend.delete("ns", "sm-marked", "n-marked") is True
    assert localprocs.scan(backend.mark_root) == []
    assert not (backend.root / ".ports" / str(port)).exists()
    assert backend.list_all_labelled("ns") == []


def test_a_delete_between_the_record_and_the_start_starts_nothing(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release or GC pass may delete a sandbox whose record exists and whose process
    does not yet (a create in flight): the create must then start nothing, or a process
    would run with no record and no port lock."""
    spec = pod_spec("sm-raced", nonce="n-raced")
    locking = LocalBackend._record_lock
    raced: list[bool] = []

    def delete_first(self: LocalBackend, name: str) -> Any:
        if name == spec.name and not raced:
            raced.append(False)  # the delete below takes this lock too
            raced[0] = self.delete("ns", name, spec.nonce)
        return locking(self, name)

    monkeypatch.setattr(LocalBackend, "_record_lock", delete_first)
    with pytest.raises(KubeUnavailable, match="deleted before it started"):
        backend.create(spec)
    assert raced == [True]
    assert backend.get("ns", spec.name) is None
    assert backend.list_installation("ns", spec.installation) == []
    assert backend.ports.held_by(spec.name) == []
    assert not (backend.root / spec.name).exists()
