"""The client core at its seams: what both transports send, when, and what answers mean."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from broker.client import core
from broker.errors import AcquireTimeout, CreateFailed, InvalidRequest, UnknownJob
from broker.names import Queue, Task, cancel_key, result_key
from broker.wire import warm
from broker.wire.types import Lease

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _lease(expires_in_s: float | None = None, sandbox_id: str = "sb-1") -> Lease:
    expires = None if expires_in_s is None else (NOW + dt.timedelta(seconds=expires_in_s))
    return Lease(
        sandbox_id=sandbox_id,
        pod_name="p",
        address="127.0.0.1:1",
        token="t",
        lease_expires_at=expires.isoformat() if expires else None,
    )


def _request(**kwargs: object) -> dict[str, object]:
    return core.new_request("me", image="python:3.12", job="j", **kwargs)


@pytest.mark.parametrize(("lease_s", "interval"), [(30.0, 10.0), (60.0, 20.0), (900.0, 300.0)])
def test_heartbeat_is_a_third_of_the_lease(lease_s: float, interval: float) -> None:
    assert core.heartbeat_interval(_lease(lease_s), None, NOW) == pytest.approx(interval)


def test_heartbeat_override_floor_and_default() -> None:
    assert core.heartbeat_interval(_lease(30.0), 0.3, NOW) == core.MIN_HEARTBEAT_S
    assert core.heartbeat_interval(_lease(30.0), 5.0, NOW) == 5.0
    assert core.heartbeat_interval(_lease(None), None, NOW) == core.DEFAULT_HEARTBEAT_S
    assert core.heartbeat_interval(_lease(1.5), None, NOW) == core.MIN_HEARTBEAT_S


def test_schedule_renews_what_is_due_and_sleeps_until_the_next() -> None:
    sched = core.HeartbeatSchedule()
    sched.add("a", 10.0, now=0.0)
    sched.add("b", 4.0, now=0.0)
    assert sched.due(3.9) == []
    assert sched.wait_s(3.9) == pytest.approx(0.1)
    assert sched.due(4.0) == ["b"]
    assert sched.wait_s(4.0) == pytest.approx(4.0)  # b next at 8, a at 10
    assert sorted(sched.due(10.0)) == ["a", "b"]
    sched.remove("a")
    assert sched.held() == 1
    sched.remove("b")
    assert sched.wait_s(10.0) == core.HeartbeatSchedule.IDLE_WAIT_S


def test_messages_travel_on_their_tasks_queues() -> None:
    request = _request()
    assert core.acquire_message(request) == (Task.ACQUIRE, [request], Queue.ACQUIRE)
    assert core.release_message("x") == (Task.RELEASE, ["x", "released"], Queue.RELEASE)
    beats = core.heartbeat_messages(["a", "b"], "me")
    assert core.batches(beats) == {(Task.HEARTBEAT, Queue.RELEASE): [["a", "me"], ["b", "me"]]}


def test_warm_outcome_hands_out_or_releases() -> None:
    request, lease = _request(), _lease()
    handed = core.warm_outcome(lease, request, "me", 0.01, True)
    assert handed.task == Task.CLAIMED and handed.queue == Queue.RELEASE
    assert handed.args[:3] == ["sb-1", request["request_id"], "me"]
    sick = core.warm_outcome(lease, request, "me", 0.01, False)
    assert sick == core.release_message("sb-1", "warm-unhealthy")


def test_warm_claim_names_the_requests_pool() -> None:
    request = _request(cpu="500m", memory="512Mi")
    keys, args = core.warm_claim(request)
    key = warm.pool_key("python:3.12", None, None, 500, 512 << 20)
    assert keys == list(warm.pool_keys("j", key))
    assert args[0] == request["request_id"]


def test_group_requests_are_independent_and_bounded() -> None:
    group = core.group_requests(3, "me", image="python:3.12", job="j", timeout=5)
    assert len({r["request_id"] for r in group}) == 3
    for n in (0, core.MAX_GROUP + 1):
        with pytest.raises(InvalidRequest):
            core.group_requests(n, "me", image="python:3.12", job="j")


def test_unknown_or_missing_arguments_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="unknown"):
        _request(gpu=1)
    with pytest.raises(InvalidRequest, match="missing"):
        core.new_request("me", image="python:3.12")


def test_mailbox_wait_pops_until_the_deadline() -> None:
    request = _request(timeout=12)
    wait = core.MailboxWait(request)
    start = float(request["enqueued_at"])  # type: ignore[arg-type]
    assert wait.key == result_key(str(request["request_id"]))
    assert wait.next_pop(start) == core.POP_WAIT_S
    assert wait.next_pop(start + 10) == pytest.approx(2.0)
    assert wait.next_pop(start + 12) is None
    assert isinstance(wait.timed_out(), AcquireTimeout)
    keys, _ = wait.cancel_call()
    assert keys == [wait.key, cancel_key(str(request["request_id"]))]


def test_settle_decodes_a_lease_or_raises_the_workers_error() -> None:
    lease = _lease(30.0)
    assert core.settle(json.dumps({"lease": lease.to_dict()})) == lease
    with pytest.raises(UnknownJob):
        core.settle(json.dumps({"error": {"code": "unknown_job", "message": "no"}}))
    with pytest.raises(CreateFailed):
        core.settle(json.dumps({"error": {"code": "create_failed", "message": "no"}}))


def test_a_late_lease_is_released_on_give_up() -> None:
    assert core.late_releases(None) == []
    assert core.late_releases(json.dumps({"error": {"code": "x"}})) == []
    late = json.dumps({"lease": _lease(sandbox_id="late").to_dict()})
    assert core.late_releases(late) == [core.release_message("late")]
