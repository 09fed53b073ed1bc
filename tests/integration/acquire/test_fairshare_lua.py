"""The fair scheduler's Lua, alone against real Redis: which request each pop serves.

No workers here: requests are pushed the way the trainer client pushes them and popped the
way a worker pops them, so every order below is the scheduler's, exactly (no timing).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.acquire.fairshare import PROC, WAKE, FairQueue, Pop, conf_fields
from broker.pacing import Limits, Pacer, reserve_horizon
from broker.wire import fairq, mailbox
from broker.wire.request import AcquireRequest
from tests.integration.conftest import flushed_db
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = "localhost/sandman-task-base:v1"


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    with flushed_db(redis_url, 13) as url:
        client = redis.Redis.from_url(url)
        yield client
        client.close()


def queue(r: redis.Redis, *, gate: int = 1000, lease_s: float = 30.0) -> FairQueue:
    return FairQueue(r, lease_s=lease_s, gate=gate)


def push(r: redis.Redis, job: str, n: int, role: str = "rollout") -> list[str]:
    requests = [
        AcquireRequest.new(image=IMAGE, job=job, role=role, timeout=600).to_wire() for _ in range(n)
    ]
    fairq.push_all(r, requests)
    return [q["request_id"] for q in requests]


def served(q: FairQueue, n: int) -> list[tuple[str, str]]:
    """(job, role) of the next n pops, each finished at once."""
    out = []
    for _ in range(n):
        got = q.pop()
        assert got.kind == "ok", got
        assert got.body is not None
        out.append((got.body["job"], got.body["role"]))
        q.done(got.request_id)
    return out


def jobs(order: list[tuple[str, str]]) -> list[str]:
    return [job for job, _ in order]


def test_a_burst_does_not_delay_a_later_job_beyond_its_share(r: redis.Redis) -> None:
    q = queue(r)
    push(r, "a", 1000)
    assert jobs(served(q, 10)) == ["a"] * 10
    push(r, "b", 3)
    # b joins at the current virtual time: equal weights alternate from here on
    order = jobs(served(q, 6))
    assert order.count("b") == 3
    assert order.index("b") <= 1
    assert max(i for i, job in enumerate(order) if job == "b") <= 5


def test_weights_one_and_three_share_one_to_three_by_order(r: redis.Redis) -> None:
    q = queue(r)
    q.publish_conf(conf_fields([("a", None, 1.0, None, None), ("b", None, 3.0, None, None)], {}))
    push(r, "a", 200)
    push(r, "b", 200)
    order = jobs(served(q, 200))
    counts = collections.Counter(order)
    assert counts["b"] == 150 and counts["a"] == 50
    for k in range(4, 201, 4):  # every prefix is within one request of the ratio
        assert abs(order[:k].count("b") - 3 * k / 4) <= 1


def test_a_tenant_weight_is_split_among_its_active_jobs(r: redis.Redis) -> None:
    q = queue(r)
    fields = conf_fields(
        [
            ("t1-a", "t1", 1.0, None, None),
            ("t1-b", "t1", 1.0, None, None),
            ("solo", None, 1, None, None),
        ],
        {"t1": 2.0},
    )
    q.publish_conf(fields)
    for job in ("t1-a", "t1-b", "solo"):
        push(r, job, 100)
    counts = collections.Counter(jobs(served(q, 120)))
    # tenant t1 (weight 2) gets 2/3, split evenly between its two jobs; solo 1/3
    assert counts == {"t1-a": 40, "t1-b": 40, "solo": 40}


def test_more_jobs_do_not_give_a_tenant_more_than_its_weight(r: redis.Redis) -> None:
    q = queue(r)
    many = [(f"t1-{i}", "t1", 1.0, None, None) for i in range(5)]
    q.publish_conf(conf_fields([*many, ("t2-a", "t2", 1.0, None, None)], {}))
    for job, *_ in many:
        push(r, job, 40)
    push(r, "t2-a", 100)
    counts = collections.Counter(jobs(served(q, 100)))
    assert counts["t2-a"] == 50


def test_grading_goes_before_rollouts_of_its_tenant_but_not_before_others(
    r: redis.Redis,
) -> None:
    q = queue(r)
    q.publish_conf(
        conf_fields(
            [
                ("t1-roll", "t1", 1.0, None, None),
                ("t1-grade", "t1", 1.0, None, None),
                ("other", None, 1.0, None, None),
            ],
            {},
        )
    )
    push(r, "t1-roll", 20)
    push(r, "other", 20)
    push(r, "t1-grade", 5, role="grading")
    order = served(q, 20)
    t1 = [(job, role) for job, role in order if job.startswith("t1")]
    assert [role for _, role in t1[:5]] == ["grading"] * 5  # before every rollout of t1
    assert jobs(order).count("other") == 10  # the tenant's share did not grow


def test_a_cancelled_queued_request_is_dropped_uncharged(r: redis.Redis) -> None:
    q = queue(r)
    a = push(r, "a", 3)
    push(r, "b", 3)
    mailbox.cancel(r, a[0])
    mailbox.cancel(r, a[1])
    got = [q.pop() for _ in range(4)]
    ids = [g.request_id for g in got]
    assert a[0] not in ids and a[1] not in ids
    assert a[2] in ids
    assert q.pop().kind == "empty"
    assert int(r.hget(f"{fairq.PREFIX}:stats", "dropped") or 0) == 2
    assert not r.hexists(fairq.BODIES, a[0])


def test_a_request_whose_worker_died_goes_back_to_the_head(r: redis.Redis) -> None:
    q = queue(r, lease_s=0.3)
    (first,) = push(r, "a", 1)
    assert q.pop().request_id == first  # then the worker is "killed": no renew, no done
    q._held.clear()
    pops: list[Pop] = []

    def redelivered() -> bool:
        pops.append(q.pop())
        return pops[-1].kind == "ok"

    wait_until(redelivered, timeout=60, interval=0.05, what="the lease to run out")
    assert (pops[-1].request_id, pops[-1].swept) == (first, 1)
    assert {p.kind for p in pops[:-1]} <= {"empty"}


def test_renewal_moves_the_lease_of_held_requests_only(r: redis.Redis) -> None:
    q = queue(r, lease_s=30.0)
    first, second = push(r, "a", 2)
    assert q.pop().request_id == first
    before = float(r.zscore(PROC, first) or 0)
    wait_until(lambda: float(r.time()[0]) > before - 30.0 + 0.5 or None, interval=0.05)
    assert q.renew_held() == 1
    assert float(r.zscore(PROC, first) or 0) > before
    assert r.zscore(PROC, second) is None  # renewal never re-adds what is not held
    q.done(first)
    assert q.renew_held() == 0 and r.zscore(PROC, first) is None


def test_the_gate_bounds_requests_waiting_for_a_token(r: redis.Redis) -> None:
    q = queue(r, gate=2)
    ids = push(r, "a", 4)
    one, two = q.pop(), q.pop()
    assert q.pop().kind == "gated"
    q.ungate(one.request_id)  # its token is reserved now: one gated worker is woken
    assert r.blpop([WAKE], timeout=1) is not None
    three = q.pop()
    assert [one.request_id, two.request_id, three.request_id] == ids[:3]


def test_a_job_waiting_for_its_own_bucket_lets_others_go(r: redis.Redis) -> None:
    q = queue(r)
    q.publish_conf(conf_fields([("slow", None, 1.0, 0.2, 1), ("fast", None, 1.0, None, None)], {}))
    pacer = Pacer(r)
    slow = Limits(rate=1000, burst=1000, max_concurrent=100, job="slow", job_rate=0.2, job_burst=1)
    assert pacer.reserve(slow, max_wait=0) is not None  # slow's bucket is empty for 5 s now
    push(r, "slow", 5)
    push(r, "fast", 5)
    assert jobs(served(q, 5)) == ["fast"] * 5
    waiting = q.pop()
    assert waiting.kind == "wait" and waiting.wait_s > 1.0


def test_weights_change_at_run_time(r: redis.Redis) -> None:
    q = queue(r)
    push(r, "a", 400)
    push(r, "b", 400)
    assert collections.Counter(jobs(served(q, 40))) == {"a": 20, "b": 20}
    q.publish_conf(conf_fields([("b", None, 3.0, None, None)], {}))
    counts: dict[str, Any] = collections.Counter(jobs(served(q, 80)))
    assert abs(counts["b"] - 60) <= 1


def test_a_newcomer_waits_only_for_the_tokens_reserved_within_one_interval(
    r: redis.Redis,
) -> None:
    """Four workers serve a bursting job at 25 creates/s the way the acquire path does
    (pop, take the pacer's token, leave the gate once it is reserved). Another job's
    request arriving then is served next, so the only creates of the burst that start
    before it are those whose tokens were reserved by then, which the horizon (one
    interval) bounds, and the one or two popped before its arrival was seen.

    Compared by the starts the pacer reserved (Redis time), not by when anything ran."""
    rate = 25.0
    limits = Limits(rate=rate, burst=1, max_concurrent=1000)
    q, pacer = queue(r, gate=1), Pacer(r)
    push(r, "burst", 400)
    starts: list[tuple[float, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            got = q.pop()
            if got.kind == "gated":
                q.wait_gate(0.05)
                continue
            assert got.kind == "ok" and got.body is not None, got
            ungate = functools.partial(q.ungate, got.request_id)
            start = pacer.take(limits, deadline=time.monotonic() + 600, on_reserved=ungate)
            with lock:
                starts.append((start, got.body["job"]))
            q.done(got.request_id)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(starts) >= 10, timeout=120, interval=0.05, what="the burst going")
    arrived = pacer.server_time()
    push(r, "newcomer", 1)
    wait_until(
        lambda: any(job == "newcomer" for _, job in starts),
        timeout=120,
        interval=0.05,
        what="the newcomer's create",
    )
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    (mine,) = [start for start, job in starts if job == "newcomer"]
    ahead = [start for start, job in starts if job == "burst" and arrived < start < mine]
    # reserved by then: within one interval (``reserve_horizon``) after ``arrived``, so
    # at most one; popped before the arrival was seen: the one in the gate, and the next
    # if it left the gate just then. (A fixed 0.25 s horizon gave four here, every time.)
    assert reserve_horizon(rate) == pytest.approx(1 / rate)
    assert len(ahead) <= 1 + 2, (len(ahead), sorted(starts))
