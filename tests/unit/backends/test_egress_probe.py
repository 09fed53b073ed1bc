"""The egress probe's verdict logic, its listener and its in-pod script (no cluster)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.backends.kube.egress_probe import (
    POD_SCRIPT,
    Attempt,
    EgressVerdict,
    PodOutcome,
    _Listener,
    classify,
)
from broker.errors import ConfigError

pytestmark = pytest.mark.unit

OK = Attempt(connected=True, banner_ok=True, error="", elapsed_s=0.01)
WRONG_PEER = Attempt(connected=True, banner_ok=False, error="", elapsed_s=0.01)
TIMEOUT = Attempt(connected=False, banner_ok=None, error="TimeoutError: timed out", elapsed_s=2)


def _pod(denied: bool, *attempts: Attempt, ip: str = "", problem: str = "") -> PodOutcome:
    name = "p-denied" if denied else "p-allowed"
    return PodOutcome(name, denied, pod_ip=ip, attempts=list(attempts), problem=problem)


def test_enforced_when_denied_blocked_and_allowed_connects() -> None:
    verdict, message = classify(_pod(True, TIMEOUT), _pod(False, OK))
    assert verdict is EgressVerdict.ENFORCED
    assert "early" not in message


def test_not_enforced_when_denied_connects() -> None:
    verdict, message = classify(_pod(True, OK, OK, OK), _pod(False, OK))
    assert verdict is EgressVerdict.NOT_ENFORCED
    assert "NOT enforced" in message
    # reaching some other peer is still egress
    assert classify(_pod(True, WRONG_PEER), _pod(False, OK))[0] is EgressVerdict.NOT_ENFORCED


def test_early_leak_then_block_is_enforced_with_a_note() -> None:
    verdict, message = classify(
        _pod(True, OK, TIMEOUT, ip="10.244.0.9"), _pod(False, OK), ["10.244.0.9"]
    )
    assert verdict is EgressVerdict.ENFORCED
    assert "1 early attempt" in message


def test_inconclusive_when_allowed_pod_cannot_connect_or_a_pod_never_ran() -> None:
    verdict, message = classify(_pod(True, TIMEOUT), _pod(False, TIMEOUT, TIMEOUT))
    assert verdict is EgressVerdict.INCONCLUSIVE
    assert "allowed pod cannot reach" in message
    # the allowed pod reaching a different peer than our listener proves nothing
    assert classify(_pod(True, TIMEOUT), _pod(False, WRONG_PEER))[0] is EgressVerdict.INCONCLUSIVE
    verdict, message = classify(
        _pod(True, problem="timed out (ErrImageNeverPull)"), _pod(False, OK)
    )
    assert verdict is EgressVerdict.INCONCLUSIVE
    assert "ErrImageNeverPull" in message


def _run_script(tmp_path: Path, **args: object) -> dict[str, Any]:
    report = tmp_path / "report.json"
    base = {"delay_s": 0, "attempts": 3, "interval_s": 0.05, "timeout_s": 0.5, "banner": ""}
    payload = {**base, **args, "report": str(report)}
    subprocess.run(
        [sys.executable, "-c", POD_SCRIPT, json.dumps(payload)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def test_pod_script_against_the_listener(tmp_path: Path) -> None:
    banner = "sandman-egress-probe abc"
    listener = _Listener("127.0.0.1", banner)
    try:
        ok, wrong = (
            _run_script(
                tmp_path,
                host="127.0.0.1",
                port=listener.port,
                banner=expected,
                stop_when_connected=True,
            )
            for expected in (banner, "another nonce")
        )
    finally:
        listener.close()
    assert ok["attempts"] == [
        {"connected": True, "banner_ok": True, "error": "", "elapsed_s": pytest.approx(0, abs=1)}
    ]
    # connected, but to a listener with another nonce: reported, never taken as ours
    assert [a["banner_ok"] for a in wrong["attempts"]] == [False]
    assert set(listener.peers) == {"127.0.0.1"} and len(listener.peers) == 2


def test_pod_script_stops_at_first_block_for_the_denied_pod(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    blocked = _run_script(tmp_path, host="127.0.0.1", port=port, stop_when_connected=False)
    attempts = blocked["attempts"]
    assert isinstance(attempts, list) and len(attempts) == 1
    assert attempts[0]["connected"] is False and "Refused" in attempts[0]["error"]


def test_listener_on_a_foreign_address_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot listen on 192\.0\.2\.254"):
        _Listener("192.0.2.254", "x")
