"""What counts as activity for the idle reclaim, and the refusal once reclaimed (execd/activity.py).

Every test is a handshake or an ordering, never a timing: "status reads do not reset the
idle clock" compares two idle readings taken around them; "a running command keeps it"
holds the command on a file the test creates only after its reclaim was refused.
"""

from __future__ import annotations

import threading

import pytest

from tests.integration.execd.test_stream import stream
from tests.support.execd_daemon import Client, Daemon
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
FOREVER = 1e9  # an idle timeout no test reaches: the reply only reports


def reclaim(c: Client, timeout_s: float, held_s: float = FOREVER) -> dict:
    return c.post("/v1/reclaim", {"idle_timeout_s": timeout_s, "held_s": held_s})


def idle_s(c: Client) -> float:
    return float(reclaim(c, FOREVER)["idle_s"])


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def test_idle_sandbox_is_reclaimed_then_every_call_is_refused(daemon: Daemon) -> None:
    c = daemon.client()
    assert c.exec("echo hi")["stdout"] == "hi\n"
    got = wait_until(lambda: reclaim(c, 0.2)["reclaimed"], what="the reclaim")
    assert got is True
    for path, body in (("/v1/exec", {"command": "true"}), ("/v1/info", None)):
        code, doc = c.request("POST" if body else "GET", path, body)
        assert code == 410 and doc["error"]["code"] == "reclaimed", (path, code, doc)
    code, doc = c.request("POST", "/v1/heartbeat", {})
    assert code == 410
    assert reclaim(c, FOREVER)["reclaimed"] is True  # idempotent, whatever the timeout
    code, _ = c.request("GET", "/healthz", auth=False)
    assert code == 200  # the pod's probe still answers until the broker deletes it


def test_status_reads_and_heartbeats_do_not_reset_the_idle_clock(daemon: Daemon) -> None:
    c = daemon.client()
    c.exec("true")
    before = wait_until(lambda: idle_s(c) if idle_s(c) > 0.05 else 0, what="some idleness")
    c.request("GET", "/v1/info")
    c.post("/v1/heartbeat", {})
    c.request("GET", "/healthz")
    after = idle_s(c)
    assert after >= before
    c.exec("true")  # a real call does reset it
    assert idle_s(c) < after


def test_the_hand_out_bounds_the_idle_time(daemon: Daemon) -> None:
    """Idle since before its hand-out (a warm sandbox) counts only from the hand-out."""
    c = daemon.client()
    wait_until(lambda: idle_s(c) > 0.05, what="some idleness")
    reply = reclaim(c, 0.01, held_s=0.0)
    assert reply == {"reclaimed": False, "idle_s": 0.0, "running": 0}


def test_a_running_command_keeps_it_until_it_ends(daemon: Daemon, tmp_path) -> None:
    gate = tmp_path / "go"
    c, other = daemon.client(), daemon.client()
    result: dict = {}
    cmd = f"while [ ! -e {gate} ]; do sleep 0.02; done; echo done"
    worker = threading.Thread(target=lambda: result.update(c.exec(cmd, timeout=600)))
    worker.start()
    wait_until(lambda: reclaim(other, FOREVER)["running"], what="the exec to run")
    reply = reclaim(other, 0.01)
    assert reply["reclaimed"] is False and reply["running"] == 1
    wait_until(lambda: reclaim(other, 0.01)["idle_s"] >= 0.05, what="idle time to pass")
    assert reclaim(other, 0.01)["reclaimed"] is False  # idle for long, but busy
    gate.touch()
    worker.join()
    assert result["stdout"] == "done\n"
    assert wait_until(lambda: reclaim(other, 0.2)["reclaimed"], what="the reclaim after it ended")


def test_a_streamed_run_keeps_it_until_its_stream_closes(daemon: Daemon, tmp_path) -> None:
    gate = tmp_path / "go"
    other = daemon.client()
    seen: list[dict] = []

    def on_frame(frame: dict) -> None:
        if frame["type"] == "stdout" and not gate.exists():  # running: the first output
            seen.append(reclaim(other, 0.01))
            gate.touch()

    frames = stream(
        daemon, {"cmd": f"echo started; while [ ! -e {gate} ]; do sleep 0.02; done"}, on_frame
    )
    assert frames[-1]["type"] == "result"
    assert seen[0]["reclaimed"] is False and seen[0]["running"] == 1
    assert wait_until(lambda: reclaim(other, 0.1)["reclaimed"], what="the reclaim")


def test_a_reclaim_needs_its_timeout(daemon: Daemon) -> None:
    c = daemon.client()
    code, doc = c.request("POST", "/v1/reclaim", {})
    assert code == 400 and doc["error"]["code"] == "missing_field"
    code, _ = c.request("POST", "/v1/reclaim", {"idle_timeout_s": 1}, auth=False)
    assert code == 401
