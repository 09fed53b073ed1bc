"""The stack's restart policy and exit descriptions, and the process-tree walk a stop uses."""

from __future__ import annotations

import signal

import pytest

from broker.local.reclaim import descendants
from broker.local.stack import RestartPolicy, describe_exit

pytestmark = pytest.mark.unit


def test_backoff_doubles_inside_the_window_and_is_capped() -> None:
    policy = RestartPolicy(limit=10, window_s=60.0, base_s=0.5, cap_s=4.0)
    delays = [policy.record("worker-acquire", t) for t in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_an_exit_after_a_quiet_window_restarts_at_once() -> None:
    policy = RestartPolicy(limit=3, window_s=60.0, base_s=0.5)
    for t in (0.0, 1.0, 2.0):
        assert policy.record("beat", t) is not None
    assert policy.record("beat", 500.0) == 0.5


def test_too_many_exits_in_the_window_is_a_crash_loop() -> None:
    policy = RestartPolicy(limit=3, window_s=60.0)
    assert [policy.record("beat", t) is None for t in (0.0, 1.0, 2.0, 3.0)] == [
        False,
        False,
        False,
        True,
    ]
    assert policy.record("worker-control", 3.0) is not None  # counted per child


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def test_descendants_walks_the_whole_tree_below_a_root_only() -> None:
    table = {10: 1, 11: 10, 12: 11, 13: 12, 20: 1, 21: 20}
    assert sorted(descendants(10, table)) == [11, 12, 13]
    assert descendants(13, table) == []
