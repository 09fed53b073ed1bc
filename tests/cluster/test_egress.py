"""Egress denial is enforced on the local cluster, and the probe tells when it is not.

The local cluster runs kube-network-policies for the real node (deploy/localcluster/up.sh).
With it, a pod labelled ``sandman.io/egress=denied`` under the broker's per-job
NetworkPolicy cannot reach a listener on the host's bridge address while an egress-allowed
pod of the same job can, and ``probe_egress`` says ``enforced``. With the engine stopped
(by its recorded PID; the test restarts it with up.sh afterwards) the same policy is inert
and the probe says ``not enforced``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.backends.kube.api import Kube
from broker.backends.kube.egress_probe import EgressVerdict, format_result, probe_egress
from tests.cluster.conftest import (
    POLICY_ENGINE,
    REAL_NODE_SELECTOR,
    TASK_BASE_IMAGE,
    UP_SCRIPT,
    cluster_state_dir,
    policy_engine_pid,
)

pytestmark = pytest.mark.cluster

STATE = cluster_state_dir()
ENGINE = POLICY_ENGINE
PROBE_INSTALLATION = "lc-test"
_engine_pid = policy_engine_pid


@pytest.fixture(scope="module")
def kube(enforcing_kube: Kube) -> Kube:
    return enforcing_kube


def _lock(lock: Any, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"{STATE / 'lock'} is held by another up.sh/down.sh")
            time.sleep(0.5)


@pytest.fixture
def engine_stopped(kube: Kube) -> Iterator[None]:
    """Stop the engine by PID for one test; restart it with up.sh afterwards, always.

    Holds up.sh's lock meanwhile: another session's up.sh would otherwise restart the
    engine in the middle of the test (it waits for the lock instead, a few seconds).
    """
    with (STATE / "lock").open("a") as lock:
        _lock(lock)
        try:
            pid = _engine_pid()
            assert pid is not None, f"{ENGINE} is not running"
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while _engine_pid() == pid and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _engine_pid() is None, f"{ENGINE} (pid {pid}) did not exit"
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            proc = subprocess.run(
                [str(UP_SCRIPT)], capture_output=True, text=True, timeout=600, check=False
            )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _engine_pid() is not None, f"up.sh did not restart {ENGINE}"


def _probe(kube: Kube, namespace: str) -> Any:
    return probe_egress(
        kube,
        namespace,
        installation=PROBE_INSTALLATION,
        image=TASK_BASE_IMAGE,
        node_selector=REAL_NODE_SELECTOR,
        timeout_s=45,
    )


def _leftovers(kube: Kube, namespace: str) -> list[str]:
    pods, _ = kube.list_pods(
        namespace, f"sandman.io/installation={PROBE_INSTALLATION}-egress-probe"
    )
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]


def test_denied_pod_is_blocked_and_allowed_pod_connects(kube: Kube, namespace: str) -> None:
    result = _probe(kube, namespace)
    report = format_result(result)
    assert result.verdict is EgressVerdict.ENFORCED, report
    # the egress-denied pod never reached the host listener, the allowed pod did
    assert result.denied.attempts and not any(a.connected for a in result.denied.attempts), report
    assert result.denied.pod_ip and result.denied.pod_ip not in result.listener_peers, report
    assert result.allowed.reached, report
    assert result.allowed.pod_ip in result.listener_peers, report
    assert result.target.startswith("10.244.0.1:"), report
    # the guard was the broker's own per-job policy, and the probe removed it and its pods
    assert result.policy.startswith("sandman-egress-egress-probe-")
    assert kube.get_object("networkpolicy", namespace, result.policy) is None
    assert _leftovers(kube, namespace) == []


def test_probe_reports_not_enforced_without_the_engine(
    kube: Kube, namespace: str, engine_stopped: None
) -> None:
    result = _probe(kube, namespace)
    report = format_result(result)
    assert result.verdict is EgressVerdict.NOT_ENFORCED, report
    assert "NOT enforced" in result.message
    assert result.denied.reached and result.denied.pod_ip in result.listener_peers, report
    assert result.allowed.reached, report
    assert _leftovers(kube, namespace) == []
