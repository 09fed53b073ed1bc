"""The replay simulator on small traces whose outcome is computed by hand."""

from __future__ import annotations

import io
import math

import pytest

from broker.errors import InvalidRequest
from broker.replay import Policy, TraceEvent, read_trace, simulate
from broker.replay.sim import percentile

pytestmark = pytest.mark.unit


def ev(t: float, image: str = "a", duration: float = 1.0) -> TraceEvent:
    return TraceEvent(time=t, job="j", image=image, role="rollout", duration=duration)


def test_hit_then_miss_then_hit_with_replacement() -> None:
    # Pool a=1 prefilled. t=0 hit; replacement ready at 2. t=1 miss (on demand, ready 3).
    # t=5 hit on the replacement (idle 2..5); its own replacement is ready at 7, idle to 13.
    trace = [ev(0, duration=10), ev(1, duration=10), ev(5, duration=1)]
    r = simulate(trace, Policy(warm={"a": 1}, create_s=2.0, hit_s=0.05, idle_timeout_s=1e9))
    assert (r.hits, r.misses) == (2, 1)
    assert (r.creates, r.creates_warm, r.creates_on_demand, r.prefilled) == (3, 2, 1, 1)
    assert sorted(r.waits) == pytest.approx([0.05, 0.05, 2.0])
    assert r.duration_s == pytest.approx(13.0)  # the on-demand pod is released last
    assert r.idle_pod_s == pytest.approx(3.0 + 6.0)
    assert r.busy_pod_s == pytest.approx(10.0 + 10.0 + 1.0)
    assert r.hit_rate == pytest.approx(2 / 3)


def test_no_pool_every_request_is_a_create() -> None:
    r = simulate([ev(0), ev(0.5, "b"), ev(3)], Policy(create_s=4.0))
    assert (r.hits, r.misses, r.creates, r.creates_warm) == (0, 3, 3, 0)
    assert r.waits == [4.0, 4.0, 4.0]
    assert r.idle_pod_s == 0.0


def test_idle_expiry_always_refill_recycles_the_pool() -> None:
    # Prefilled pod expires at 10 and is replaced (ready 12), which expires at 22 and is
    # replaced (ready 24); the request at 25 hits. Idle: 10 + 10 + 1 pod-seconds.
    p = Policy(warm={"a": 1}, idle_timeout_s=10.0, create_s=2.0, refill="always")
    r = simulate([ev(25)], p)
    assert (r.hits, r.expired) == (1, 2)
    assert r.creates == 3  # two recyclings + the replacement of the hit
    assert r.idle_pod_s == pytest.approx(21.0)


def test_idle_expiry_demand_refill_lets_the_pool_drain() -> None:
    p = Policy(warm={"a": 1}, idle_timeout_s=10.0, create_s=2.0, refill="demand")
    r = simulate([ev(25)], p)
    assert (r.hits, r.misses, r.expired) == (0, 1, 1)
    assert (r.creates_on_demand, r.creates_warm) == (1, 1)  # the miss re-arms the pool
    assert r.waits == [2.0]
    # 0..10 for the prefilled pod, then the re-armed refill idles from 27 to the end (28).
    assert r.idle_pod_s == pytest.approx(11.0)


def test_live_cap_queues_misses_until_a_release() -> None:
    r = simulate([ev(0, duration=5), ev(1, duration=5)], Policy(max_live=1, create_s=1.0))
    assert r.queued_at_cap == 1
    assert r.peak_live == 1
    assert r.waits == [1.0, 6.0]  # second create starts at the release (6), ready at 7


def test_global_warm_budget_limits_prefill() -> None:
    p = Policy(warm_default=2, max_warm=3, create_s=1.0, idle_timeout_s=1e9)
    r = simulate([ev(0, "a"), ev(0.1, "b"), ev(0.2, "b")], p)
    assert r.prefilled == 3  # a gets 2, b gets 1 (images in name order)
    assert (r.hits, r.misses) == (2, 1)


def test_reuse_serves_a_request_a_create_would_have_missed() -> None:
    # Slow creates: the replacement of the first hit is still creating when the second
    # request comes. With reuse the released pod is back in the pool and serves it.
    trace = [ev(0, duration=1), ev(2, duration=1)]
    base = Policy(warm={"a": 1}, create_s=10.0, idle_timeout_s=1e9)
    off = simulate(trace, base)
    on = simulate(trace, Policy(**{**base.__dict__, "reuse": True}))
    assert (off.hits, off.creates) == (1, 2)
    assert (on.hits, on.creates, on.reuses) == (2, 1, 2)


def test_reuse_limit_deletes_a_worn_pod() -> None:
    trace = [ev(0, duration=1), ev(2, duration=1), ev(4, duration=1)]
    p = Policy(warm={"a": 1}, create_s=100.0, reuse=True, max_reuses=1, idle_timeout_s=1e9)
    r = simulate(trace, p)
    # The warm pod is reused once (t=1.05), deleted at its second release (3.05), so the
    # third request misses; the on-demand pod it got joins the pool at 105 (reuse 2).
    assert (r.hits, r.misses) == (2, 1)
    assert r.reuses == 2


def test_reuse_without_a_pool_does_nothing() -> None:
    r = simulate([ev(0), ev(2)], Policy(reuse=True, create_s=1.0))
    assert (r.reuses, r.hits, r.creates) == (0, 0, 2)


def test_pacer_spreads_creates_at_rate_after_burst() -> None:
    r = simulate(
        [ev(0), ev(0), ev(0), ev(0)], Policy(create_s=0.0, create_rate=2.0, create_burst=2)
    )
    assert sorted(r.waits) == pytest.approx([0.0, 0.0, 0.5, 1.0])


def test_result_dict_and_percentiles() -> None:
    r = simulate([ev(0), ev(1)], Policy(create_s=3.0)).to_dict()
    assert r["wait_p50_s"] == 3.0 and r["creates_per_request"] == 1.0
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4
    assert math.isnan(percentile([], 50))


def test_read_trace_sorts_shifts_and_rejects_garbage() -> None:
    text = (
        '{"time": 105, "job": "j", "image": "b", "role": "grading", "duration": 2}\n'
        "\n# comment\n"
        '{"time": 100, "job": "j", "image": "a", "duration": 1}\n'
    )
    events = read_trace(io.StringIO(text))
    assert [(e.time, e.image, e.role) for e in events] == [(0, "a", "rollout"), (5, "b", "grading")]
    with pytest.raises(InvalidRequest, match="line 1"):
        read_trace(io.StringIO('{"image": "a"}\n'))
    with pytest.raises(InvalidRequest):
        Policy(refill="sometimes")  # type: ignore[arg-type]
