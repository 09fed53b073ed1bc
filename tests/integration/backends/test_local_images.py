"""Local sandboxes run on their task image, not on the host (issue #15 item 4, #20 item 7).

Each test makes real bubblewrap sandboxes from the project's images in the local store.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from broker.backends.local import LocalBackend
from broker.errors import ImageNotFound
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.factories import pod_spec
from tests.support.images import REPO, TASK_IMAGE

pytestmark = pytest.mark.integration


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required: apt-get install -y bubblewrap")
    return LocalBackend(Settings(state_dir=tmp_path / "state"))


def _exec(backend: LocalBackend, name: str, token: str, command: str) -> dict[str, Any]:
    for info in backend.watch_ready("ns", {name}, 30):
        assert info.ready and info.address, info
        with httpx.Client(base_url=f"http://{info.address}", timeout=30) as http:
            answer = http.post(
                "/v1/exec",
                json={"command": command, "timeout": 20},
                headers={"Authorization": f"Bearer {token}"},
            )
            result: dict[str, Any] = answer.json()
            return result
    raise AssertionError(f"{name} never became ready")


def test_host_files_are_invisible_and_shadow_is_the_images(backend: LocalBackend) -> None:
    marker = Path("/var/tmp") / f"sandman-host-only-{secrets.token_hex(6)}"
    marker.write_text("host secret")
    spec = pod_spec("sm-img-host")
    try:
        backend.create(spec)
        out = _exec(
            backend,
            spec.name,
            spec.token,
            f"test -e {marker} && echo visible || echo absent; sha256sum /etc/shadow; "
            "cat /etc/hostname; ls /root | wc -l; getent hosts localhost | head -1",
        )
    finally:
        marker.unlink()
        backend.delete("ns", spec.name, spec.nonce)
    lines = out["stdout"].splitlines()
    assert out["exit_code"] == 0, out
    assert lines[0] == "absent", "a file created on the host must not be visible"
    host_shadow = hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest()
    image_root = backend.images.rootfs(backend.images.resolve(TASK_IMAGE))
    image_shadow = hashlib.sha256((image_root / "etc/shadow").read_bytes()).hexdigest()
    assert host_shadow != image_shadow, "precondition: the image's shadow is not the host's"
    assert lines[1].split()[0] == image_shadow
    assert lines[2] == "sandman-task-base", "the image's /etc, not the host's"
    assert lines[3] == "0", "the host's home is not there"
    assert lines[4].split()[0] in ("127.0.0.1", "::1"), "localhost resolves (/etc/hosts)"


def test_each_sandbox_writes_its_own_layer_removed_at_delete(backend: LocalBackend) -> None:
    one, two = pod_spec("sm-img-one"), pod_spec("sm-img-two", nonce="n-2")
    backend.create(one)
    backend.create(two)
    try:
        wrote = _exec(backend, one.name, one.token, "echo mine > /etc/sandman-one && echo ok")
        seen = _exec(backend, two.name, two.token, "cat /etc/sandman-one 2>&1 || echo none")
    finally:
        backend.delete("ns", one.name, one.nonce)
    assert wrote["stdout"].strip() == "ok"
    assert seen["stdout"].strip().endswith("none"), "sandboxes never see each other's writes"
    image_root = backend.images.rootfs(backend.images.resolve(TASK_IMAGE))
    assert not (image_root / "etc/sandman-one").exists()
    assert not (backend.root / one.name).exists(), "the writable layer goes with the sandbox"
    backend.delete("ns", two.name, two.nonce)
    assert not (backend.root / two.name).exists()


def test_an_image_without_python_runs_execd_on_the_host_interpreter(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """The task base minus python3 (removed by whiteouts in a second layer): execd still
    starts, on the host's interpreter bound under /sandman/hostpy, and the image keeps
    having no python of its own."""
    base_layer = next((Path(backend.images.root).parent / "images").glob("rootfs-*.layer.tar"))
    (tmp_path / "wh/usr/bin").mkdir(parents=True)
    for name in ("python3", "python3.11"):
        (tmp_path / f"wh/usr/bin/.wh.{name}").touch()
    subprocess.run(["tar", "-C", tmp_path / "wh", "-cf", tmp_path / "wh.tar", "usr"], check=True)
    ref = f"localhost/sandman-test-nopython:{secrets.token_hex(4)}"
    archive = tmp_path / "nopython.tar"
    subprocess.run(
        [
            *("python3", REPO / "deploy/images/pack_image.py", "--out", archive, "--tag", ref),
            *("--layer", base_layer, "--layer", tmp_path / "wh.tar"),
        ],
        check=True,
        capture_output=True,
    )
    backend.images.import_archive(archive)
    spec = pod_spec("sm-img-nopy", image=ref)
    try:
        backend.create(spec)
        out = _exec(backend, spec.name, spec.token, "ls /usr/bin/python3* 2>&1; echo $0")
    finally:
        backend.delete("ns", spec.name, spec.nonce)
        backend.images.remove(ref)
    assert "No such file" in out["stdout"], out
    assert out["stdout"].strip().endswith("bash")


def test_a_missing_image_is_typed_before_any_row_or_process(
    sessions: Any, tmp_path: Path, backend: LocalBackend
) -> None:
    provider = Provider(Settings(state_dir=tmp_path / "state"), sessions, backend)
    with sessions.begin() as session:
        store.ensure_job(session, "missing-image-job")
    request = AcquireRequest.new(job="missing-image-job", image="localhost/sandman-missing:1")
    with pytest.raises(ImageNotFound):
        provider.intent(request)
    with pytest.raises(ImageNotFound):
        backend.create(pod_spec("sm-img-missing", image="localhost/sandman-missing:1"))
    with sessions() as session:
        rows = session.scalar(select(func.count()).where(Sandbox.request_id == request.request_id))
    assert rows == 0
    assert backend.list_all_labelled("ns") == []
    assert list(backend.root.iterdir()) in ([], [backend.root / ".ports"])


def test_the_copy_fallback_isolates_too(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where overlay mounts are refused, each sandbox gets a full copy of the root."""
    from broker.backends import local

    monkeypatch.setattr(local, "overlay_works", lambda _scratch: False)
    spec = pod_spec("sm-img-copy")
    backend.create(spec)
    try:
        assert (backend.root / spec.name / "rootfs" / "etc/hostname").exists()
        out = _exec(backend, spec.name, spec.token, "echo x > /etc/copied && cat /etc/hostname")
    finally:
        backend.delete("ns", spec.name, spec.nonce)
    assert out["stdout"].strip() == "sandman-task-base"
    image_root = backend.images.rootfs(backend.images.resolve(TASK_IMAGE))
    assert not (image_root / "etc/copied").exists()
    assert not (backend.root / spec.name).exists()
