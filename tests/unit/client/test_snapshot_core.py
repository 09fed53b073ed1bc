"""The client's snapshot decisions, shared by both transports."""

from __future__ import annotations

import json

import pytest

from broker.client import core
from broker.errors import InvalidRequest, SnapshotCorrupt
from broker.names import Queue, Task
from broker.wire.snapshots import Snapshot

SNAP = Snapshot(
    id="s1", image="img:v1", image_digest="sha256:x", size=3, created="2026-01-01", job="j"
)

pytestmark = pytest.mark.unit


def test_open_arguments_and_the_snapshot_are_split() -> None:
    assert core.split_snapshot({"image": "i", "job": "j"}) == ({"image": "i", "job": "j"}, None)
    assert core.split_snapshot({"image": "i", "snapshot": SNAP}) == ({"image": "i"}, "s1")
    with pytest.raises(InvalidRequest):
        core.split_snapshot({"snapshot": 3})


def test_resume_takes_the_snapshots_image_and_job_unless_told_otherwise() -> None:
    assert core.resume_args(SNAP, {}) == {"image": "img:v1", "job": "j", "snapshot": "s1"}
    assert core.resume_args(SNAP, {"job": "other", "timeout": 5})["job"] == "other"


def test_snapshot_ops_travel_on_the_acquire_queue_with_ids_only() -> None:
    request, out = core.snapshot_op("restore", 30.0, "me", sandbox_id="sb", snapshot_id="s1")
    assert (out.task, out.queue) == (Task.SNAPSHOT, Queue.ACQUIRE)
    assert out.args == [request]
    assert request["deadline"] - request["enqueued_at"] == pytest.approx(30.0)
    assert {k: request[k] for k in ("op", "sandbox_id", "snapshot_id", "owner")} == {
        "op": "restore", "sandbox_id": "sb", "snapshot_id": "s1", "owner": "me",
    }  # fmt: skip
    with pytest.raises(InvalidRequest):
        core.snapshot_op("explode", 30.0, "me")


def test_answers_decode_to_a_snapshot_or_the_typed_error() -> None:
    doc = {"id": "s1", "image": "i", "image_digest": None, "size": 3, "created": "t", "job": "j"}
    assert core.settle_snapshot(json.dumps({"snapshot": doc})).id == "s1"
    error = {"error": {"code": "snapshot_corrupt", "message": "blob_mismatch"}}
    with pytest.raises(SnapshotCorrupt, match="blob_mismatch"):
        core.settle_snapshot(json.dumps(error))
