"""The execd token is invisible inside a local sandbox: no environ block, no argv holds it."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import httpx
import pytest

from broker.backends.base import PodSpec
from broker.backends.local import LocalBackend
from broker.settings import Settings
from broker.wire.execd import execd_answers
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration


def test_token_is_not_readable_from_any_proc_entry_in_the_sandbox(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required: apt-get install -y bubblewrap")
    backend = LocalBackend(Settings(state_dir=tmp_path / "state"))
    token = secrets.token_hex(32)
    spec = PodSpec(
        name="sm-token",
        namespace="ns",
        installation="inst-test",
        job="j",
        sandbox_id="sm-token",
        nonce="n-1",
        role="rollout",
        image=TASK_IMAGE,
        cpu_m=500,
        memory_b=256 << 20,
        token=token,
    )
    backend.create(spec)
    try:
        info = next(iter(backend.watch_ready("ns", {"sm-token"}, 20)))
        assert info.ready and info.address, info
        assert execd_answers(info.address, token)  # execd did get the token
        command = (
            "cat /proc/1/environ; cat /proc/self/environ; "
            f"grep -r {token} /proc/*/environ /proc/*/cmdline 2>/dev/null; true"
        )
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"http://{info.address}", headers=headers) as http:
            out = http.post("/v1/exec", json={"command": command, "timeout": 30}).json()
        assert out["exit_code"] == 0, out
        assert out["stdout"], "the environ blocks were readable (the check checked something)"
        assert token not in out["stdout"] and token not in out["stderr"]
    finally:
        backend.delete("ns", "sm-token", "n-1")
