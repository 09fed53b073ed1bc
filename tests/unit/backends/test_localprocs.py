"""The local sandbox marker: one path segment per part, found by a /proc scan, the first
occurrence only, and immune to PID reuse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker.backends import localprocs
from broker.errors import KubeInvalid
from tests.support.wait import wait_until

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", ["", "a/b", ".", "..", "x\0y"])
def test_a_part_that_is_not_one_path_segment_is_refused(bad: str) -> None:
    with pytest.raises(KubeInvalid):
        localprocs.marker(Path("/s/local-pods"), "inst", "ns", bad, "nonce")


def _marked(*args: str) -> subprocess.Popen[bytes]:
    """A stand-in process whose argv carries marker options (as bubblewrap's does)."""
    code = "import sys, time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code, *args])


def test_scan_finds_the_first_marker_and_is_marked_checks_the_whole_of_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "local-pods"
    mark = localprocs.marker(root, "inst", "ns", "sm-1", "n-1")
    forged = localprocs.marker(root, "inst", "ns", "sm-2", "n-2")
    proc = _marked(*localprocs.marker_args(mark), *localprocs.marker_args(forged))
    other = _marked(*localprocs.marker_args(localprocs.marker(tmp_path / "x", "i", "n", "a", "b")))
    try:
        found = wait_until(lambda: localprocs.scan(root), timeout=30, interval=0.05)
        assert found == [localprocs.SandboxProcess(proc.pid, "inst", "ns", "sm-1", "n-1")]
        assert localprocs.is_marked(proc.pid, mark)
        assert not localprocs.is_marked(proc.pid, forged), "only the first marker counts"
        assert not localprocs.is_marked(other.pid, mark)
        localprocs.kill(found)
        proc.wait()
        assert localprocs.scan(root) == []
        assert not localprocs.is_marked(proc.pid, mark)
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_a_helper_is_found_by_the_marker_in_its_argv0(tmp_path: Path) -> None:
    """The uplink (slirp4netns) takes options of its own: its argv[0] is the marker."""
    root = tmp_path / "local-pods"
    mark = localprocs.marker(root, "inst", "ns", "sm-h", "n-h")
    code = "import time; time.sleep(60)"
    helper = subprocess.Popen(
        [localprocs.helper_argv0(mark), "-c", code], executable=sys.executable
    )
    try:
        found = wait_until(lambda: localprocs.scan(root), timeout=30, interval=0.05)
        assert found == [localprocs.SandboxProcess(helper.pid, "inst", "ns", "sm-h", "n-h")]
        assert localprocs.is_marked(helper.pid, mark)
        localprocs.kill(found)
        helper.wait()
        assert localprocs.scan(root) == []
    finally:
        helper.kill()
        helper.wait()
