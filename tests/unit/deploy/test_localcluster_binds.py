"""The local cluster's control plane listens on loopback only (issue 20, item 12): its API
server once bound 0.0.0.0, reachable from every interface of the machine and from every
pod, though all of its clients run in the host's network namespace.

deploy/localcluster/up.sh is not run by the unit tier (it builds a whole cluster), so this
reads the flags it passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

UP = Path(__file__).resolve().parents[3] / "deploy" / "localcluster" / "up.sh"


def test_every_control_plane_listener_of_the_local_cluster_is_loopback() -> None:
    text = UP.read_text()
    binds = re.findall(r"--(?:metrics-)?bind-address[ =]\"?([^\s\":]+)", text)
    assert len(binds) >= 4  # apiserver, controller-manager, scheduler, network policies
    assert set(binds) == {"127.0.0.1"}, binds
    apiserver = text[text.index('start kube-apiserver "') :].split("\n\n", 1)[0]
    assert "--bind-address 127.0.0.1" in apiserver
