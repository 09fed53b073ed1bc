"""SandboxReclaimed on every road a trainer can hear it: execd's 410, the worker's error
payload, and the broker's marker once the pod is gone (broker/client/core.py)."""

from __future__ import annotations

import json

import pytest

from broker.client import core
from broker.errors import InfrastructureError, SandboxLost, SandboxReclaimed
from broker.names import reclaimed_key
from broker.wire.errors import raise_payload_error
from broker.wire.execd import exec_call, reclaim_call, refusal

pytestmark = pytest.mark.unit


def test_execd_410_reclaimed_is_sandbox_reclaimed() -> None:
    err = refusal(410, {"code": "reclaimed", "message": "reclaimed after 3 s idle"}, exec_call("x"))
    assert isinstance(err, SandboxReclaimed) and isinstance(err, SandboxLost)
    assert isinstance(err, InfrastructureError) and not err.retryable
    assert "reclaimed after 3 s idle" in str(err)
    other = refusal(410, {"code": "gone_elsewhere"}, exec_call("x"))
    assert not isinstance(other, SandboxReclaimed)


def test_the_wire_code_decodes_to_the_same_class() -> None:
    with pytest.raises(SandboxReclaimed, match="idle"):
        raise_payload_error({"error": {"code": "sandbox_reclaimed", "message": "idle"}})


def test_a_lost_sandbox_with_the_marker_is_reclaimed() -> None:
    lost = SandboxLost("execd of sb1 is unreachable")
    assert core.lost_key(lost, "sb1") == reclaimed_key("sb1")
    err = core.lost_error(lost, "sb1", json.dumps({"idle_s": 61.7}).encode())
    assert isinstance(err, SandboxReclaimed) and "after 62 s idle" in str(err)
    assert core.lost_error(lost, "sb1", None) is lost
    assert isinstance(core.lost_error(lost, "sb1", b"not json"), SandboxReclaimed)


def test_execd_already_said_so_costs_no_lookup() -> None:
    assert core.lost_key(SandboxReclaimed("410"), "sb1") is None


def test_the_reclaim_call_never_sends_a_negative_hold() -> None:
    call = reclaim_call(30.0, -2.0)
    assert call.path == "/v1/reclaim" and call.body == {"idle_timeout_s": 30.0, "held_s": 0.0}
