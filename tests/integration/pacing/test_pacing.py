"""The shared pacer against real Redis, from several worker PROCESSES at once.

What the API server must never see: more than ``rate * t + burst`` creates in any window
of length t, however many workers take tokens. And a SIGKILLed worker's concurrency slot
must come back by itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import redis

from broker.pacing import Limits, Pacer
from tests.integration.conftest import flushed_db
from tests.support.clocks import RecordingClock

pytestmark = pytest.mark.integration


@pytest.fixture
def pace_redis(redis_url: str):  # type: ignore[no-untyped-def]
    with flushed_db(redis_url, 12) as url:
        yield url


def _taker(url: str, limits: Limits, duration: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    pacer = Pacer(redis.Redis.from_url(url))
    stamps: list[float] = []
    end = time.time() + duration
    while True:
        got = pacer.reserve_at(limits, max_wait=max(0.0, end - time.time()))
        if got is None:
            break
        wait, start = got  # start: when the bucket lets this create go (Redis clock)
        time.sleep(wait)
        stamps.append(start)
    out.put(stamps)


def _max_excess(stamps: list[float], rate: float, burst: int) -> float:
    """Largest (count in [t_i, t_j]) - (rate * (t_j - t_i) + burst) over all windows."""
    stamps = sorted(stamps)
    worst = float("-inf")
    for i in range(len(stamps)):
        for j in range(i, len(stamps)):
            worst = max(worst, (j - i + 1) - (rate * (stamps[j] - stamps[i]) + burst))
    return worst


def test_processes_together_never_exceed_rate_and_burst(pace_redis: str) -> None:
    rate, burst, duration, procs = 40.0, 5, 3.0, 4
    limits = Limits(rate=rate, burst=burst, max_concurrent=1000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(target=_taker, args=(pace_redis, limits, duration, out)) for _ in range(procs)
    ]
    for w in workers:
        w.start()
    stamps: list[float] = []
    for _ in workers:
        stamps += out.get(timeout=60)
    for w in workers:
        w.join(timeout=10)
    assert _max_excess(stamps, rate, burst) <= 1e-3  # microsecond rounding only
    span = max(stamps) - min(stamps)
    achieved = (len(stamps) - burst) / span
    assert abs(achieved - rate) / rate < 0.05, (len(stamps), span, achieved)
    # Every process got a share: the bucket is one, the takers many.
    assert len(stamps) >= rate * duration * 0.9


def test_per_job_rate_applies_on_top_of_the_global_one(pace_redis: str) -> None:
    pacer = Pacer(redis.Redis.from_url(pace_redis))
    limits = Limits(rate=1000, burst=1000, max_concurrent=10, job="slow", job_rate=5, job_burst=1)
    waits = [pacer.reserve(limits, max_wait=10) for _ in range(6)]
    assert waits[0] == pytest.approx(0, abs=0.01)
    assert waits[5] == pytest.approx(1.0, abs=0.05)
    # A caller whose deadline is nearer than its turn reserves nothing.
    assert pacer.reserve(limits, max_wait=0.1) is None


def test_a_throttled_job_does_not_hold_other_jobs_back(pace_redis: str) -> None:
    """Ten acquires of a job limited to 4/s wait for their turns (2.25 s of them) while
    another job creates: the other job's creates go at once, inside the global burst."""
    import threading

    pacer = Pacer(redis.Redis.from_url(pace_redis))
    slow = Limits(rate=20, burst=20, max_concurrent=100, job="slow", job_rate=4, job_burst=1)
    fast = Limits(rate=20, burst=20, max_concurrent=100, job="fast")
    starts: list[float] = []

    def slow_create() -> None:
        pacer.take(slow, deadline=time.monotonic() + 10)
        starts.append(time.monotonic())

    threads = [threading.Thread(target=slow_create) for _ in range(10)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # every slow caller has asked for its turn by now
    # Same Redis state, a clock that records how long the pacer makes the fast job wait
    # (the bucket's waits are computed in Redis time, so a busy machine does not change them).
    clock = RecordingClock()
    fast_pacer = Pacer(redis.Redis.from_url(pace_redis), clock=clock)
    for _ in range(10):
        fast_pacer.take(fast, deadline=clock.monotonic() + 5)
    assert sum(clock.sleeps) < 0.2  # was > 1 s when slow turns were reserved far ahead
    for t in threads:
        t.join(15)
    assert len(starts) == 10
    starts.sort()
    assert starts[-1] - starts[0] >= 9 / 4 - 0.05  # the slow job still kept to 4/s


def test_concurrency_cap_and_killed_holder(pace_redis: str) -> None:
    pacer = Pacer(redis.Redis.from_url(pace_redis), slot_ttl_s=1.0)
    limits = Limits(rate=100, burst=100, max_concurrent=2)
    assert pacer.try_slot(limits, "a") and pacer.try_slot(limits, "b")
    assert not pacer.try_slot(limits, "c")
    pacer.release_slot(limits, "a")
    assert pacer.try_slot(limits, "c")
    pacer.release_slot(limits, "b")
    pacer.release_slot(limits, "c")
    # A worker that holds a slot and is SIGKILLed does not leak it past the slot lease.
    pid = os.fork()
    if pid == 0:  # child: take both slots, then hang until killed
        child = Pacer(redis.Redis.from_url(pace_redis), slot_ttl_s=1.0)
        child.try_slot(limits, "dead-1")
        child.try_slot(limits, "dead-2")
        time.sleep(60)
        os._exit(0)
    deadline = time.time() + 5
    while pacer.in_flight() < 2 and time.time() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert not pacer.try_slot(limits, "x")
    time.sleep(1.1)
    assert pacer.try_slot(limits, "x")
