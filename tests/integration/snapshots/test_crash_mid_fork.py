"""A worker killed in the middle of a fork leaves no unowned sandbox and no unowned blob:
the local backend (tests.support.forkcrash says what is checked; the cluster variant is
tests/cluster/test_snapshots_cluster.py).

Whether a sandbox still runs is judged by the kernel, not by the code under test: the
bubblewrap processes whose command line binds this state dir's workspaces.
"""

from __future__ import annotations

import pytest

from tests.integration.workers.test_crash_mid_create import _running_sandboxes
from tests.support.forkcrash import POINTS, kill_mid_fork
from tests.support.images import TASK_IMAGE
from tests.support.ownbroker import OwnBroker

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("point", POINTS)
def test_a_worker_killed_mid_fork_leaves_nothing_unowned(own_broker: OwnBroker, point: str) -> None:
    state_dir = own_broker.settings.state_dir
    kill_mid_fork(
        own_broker,
        point,
        spec={"image": TASK_IMAGE, "timeout": 30.0},
        running=lambda: _running_sandboxes(state_dir),
    )
