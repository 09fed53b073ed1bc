"""A worker killed in the middle of a fork leaves no unowned sandbox and no unowned blob:
the local backend, every failpoint on the filesystem store and the capture's on a real S3
server (tests.support.forkcrash says what is checked; the cluster variant is
tests/cluster/test_snapshots_cluster.py).

Whether a sandbox still runs is judged by the kernel, not by the code under test: the
bubblewrap processes whose command line binds this state dir's workspaces.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.integration.workers.test_crash_mid_create import _running_sandboxes
from tests.support.blobstores import BUCKET
from tests.support.forkcrash import LOCAL_COPY_POINT, POINTS, kill_mid_fork
from tests.support.images import TASK_IMAGE
from tests.support.ownbroker import OwnBroker
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("point", "store_kind"),
    [
        *((point, "fs") for point in POINTS),
        (LOCAL_COPY_POINT, "fs"),
        # on S3 the orphaned blobs are objects the GC must find and delete
        ("snapshot-between-blobs", "s3"),
        ("snapshot-after-blobs", "s3"),
    ],
)
def test_a_worker_killed_mid_fork_leaves_nothing_unowned(
    own_broker: OwnBroker, point: str, store_kind: str, request: pytest.FixtureRequest
) -> None:
    if store_kind == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        url = f"s3://{server.bucket(BUCKET)}/crash-{own_broker.settings.installation_id}"
        own_broker.settings = dataclasses.replace(own_broker.settings, **server.fields(url))
    if point == "restore-mid-put":  # the put pack is the streamed path: local copy off
        own_broker.settings = dataclasses.replace(own_broker.settings, snapshot_local_copy=False)
    state_dir = own_broker.settings.state_dir
    kill_mid_fork(
        own_broker,
        point,
        spec={"image": TASK_IMAGE, "timeout": 30.0},
        running=lambda: _running_sandboxes(state_dir),
    )
