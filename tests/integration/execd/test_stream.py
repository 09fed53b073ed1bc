"""Streamed runs (/v1/run/stream): frames as output comes, keepalives in the quiet, result last.

The keepalive test is a handshake, not a timing: the command waits for a file that
the test creates only after it has seen a keepalive frame, so a daemon that sends
none fails (the command times out) however loaded the machine is.
"""

import base64
import json
from pathlib import Path

import httpx
import pytest

from tests.support.execd_daemon import Daemon
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("stream"), args=["--stream-keepalive", "0.2"])
    yield d
    d.stop()


def stream(daemon, body, on_frame=None):
    """Every frame of one streamed run; ``on_frame`` sees each as it arrives."""
    frames = []
    with (
        httpx.Client(timeout=120) as http,
        http.stream(
            "POST",
            f"http://127.0.0.1:{daemon.port}/v1/run/stream",
            json=body,
            headers={"Authorization": f"Bearer {daemon.token}"},
        ) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "application/x-ndjson"
        for line in resp.iter_lines():
            frames.append(json.loads(line))
            if on_frame:
                on_frame(frames[-1])
    return frames


def output(frames, name):
    return b"".join(base64.b64decode(f["b64"]) for f in frames if f["type"] == name)


def test_frames_then_result(quick):
    frames = stream(quick, {"cmd": "echo one; echo two >&2; printf 'x\\xff'; exit 5"})
    assert output(frames, "stdout") == b"one\nx\xff" and output(frames, "stderr") == b"two\n"
    assert frames[-1] == {
        **frames[-1],
        "type": "result",
        "exit_code": 5,
        "stdout": "",
        "stderr": "",
        "stdout_total": 6,
        "stderr_total": 4,
        "truncated": False,
        "timed_out": False,
    }
    assert [f["type"] for f in frames].count("result") == 1


def test_keepalives_while_quiet(quick, tmp_path):
    seen = tmp_path / "seen-keepalive"

    def on_frame(frame):
        if frame["type"] == "keepalive":
            seen.touch()

    script = f"echo start; while [ ! -e {seen} ]; do sleep 0.05; done; echo end"
    frames = stream(quick, {"cmd": script, "timeout": 120}, on_frame)
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "stdout" and "keepalive" in kinds and kinds[-1] == "result"
    assert output(frames, "stdout") == b"start\nend\n"
    assert frames[-1]["exit_code"] == 0


def test_stream_caps_forward_the_first_bytes(quick):
    frames = stream(quick, {"cmd": "head -c 5000 /dev/zero | tr '\\0' a", "max_output_bytes": 100})
    assert output(frames, "stdout") == b"a" * 100
    assert frames[-1]["truncated"] and frames[-1]["stdout_total"] == 5000


def test_stream_timeout(quick):
    frames = stream(quick, {"cmd": "echo before; sleep 1000", "timeout": 10})
    assert output(frames, "stdout") == b"before\n"
    assert (frames[-1]["exit_code"], frames[-1]["timed_out"]) == (None, True)


def test_refusals_before_the_start_are_plain_errors(quick):
    resp = httpx.post(
        f"http://127.0.0.1:{quick.port}/v1/run/stream",
        json={"argv": ["true"], "env": {"LD_PRELOAD": "x"}},
        headers={"Authorization": f"Bearer {quick.token}"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "reserved_env"


def test_a_client_that_goes_away_kills_the_run(quick, tmp_path):
    pidfile = tmp_path / "pid"
    with (
        httpx.Client(timeout=120) as http,
        http.stream(
            "POST",
            f"http://127.0.0.1:{quick.port}/v1/run/stream",
            json={"cmd": f"echo $$ > {pidfile}; echo go; exec sleep 1000"},
            headers={"Authorization": f"Bearer {quick.token}"},
        ) as resp,
    ):
        for line in resp.iter_lines():
            if json.loads(line)["type"] == "stdout":
                break
    pid = int(pidfile.read_text())

    def gone() -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return True
        return stat[stat.rfind(b")") + 2 :].split()[0] in (b"Z", b"X")

    # The next keepalive write finds the socket closed; the run's tree is then killed.
    wait_until(gone, 60, 0.05, "the abandoned run to be killed")
    c = quick.client()
    wait_until(lambda: c.request("GET", "/v1/info")[1]["runs_active"] == 0, 30, 0.05, "slot back")
