"""The pacer's waiting decisions, driven by a fake clock: no real sleeping, no Redis.

The seam faked here is Redis: its Lua scripts answer what the test scripts (granted or
not, and the wait the bucket computed). What is checked is the pacer's side: the
reservation horizon it asks with, how long it sleeps, when it gives up, and that the
concurrency slot is taken before the token and always given back. The bucket arithmetic
itself runs in real Redis in tests/integration/pacing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from broker.errors import AcquireTimeout
from broker.pacing import RESERVE_HORIZON_S, Limits, Pacer, reserve_horizon
from tests.support.clocks import FakeClock

pytestmark = pytest.mark.unit

LIMITS = Limits(rate=10, burst=5, max_concurrent=2)
HORIZON = reserve_horizon(LIMITS.rate)  # one interval: 0.1 s


class ScriptedRedis:
    """Answers the pacer's Lua calls from queues: bucket replies (granted, wait), slot replies."""

    def __init__(self) -> None:
        self.bucket: list[tuple[bool, float]] = []
        self.slots: list[bool] = []
        self.calls: list[tuple[str, Any]] = []

    def register_script(self, lua: str) -> Callable[..., Any]:
        if "ZADD" in lua:
            return self._slot
        if "max_wait" in lua:
            return self._bucket
        return lambda **_: "0"

    def _bucket(self, *, keys: list[str], args: list[Any]) -> list[Any]:
        self.calls.append(("bucket", args[0]))  # args[0] is max_wait
        granted, wait = self.bucket.pop(0)
        return [int(granted), str(wait), str(100.0 + wait)]  # start: Redis time 100 + wait

    def _slot(self, *, keys: list[str], args: list[Any]) -> int:
        self.calls.append(("slot", args[0]))
        return int(self.slots.pop(0))

    def pipeline(self, transaction: bool = False) -> ScriptedRedis:
        return self

    def zrem(self, key: str, member: str) -> None:
        self.calls.append(("release", member))

    def execute(self) -> None:
        pass


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def redis() -> ScriptedRedis:
    return ScriptedRedis()


@pytest.fixture
def pacer(redis: ScriptedRedis, clock: FakeClock) -> Pacer:
    return Pacer(redis, clock=clock)


def test_the_horizon_is_one_interval_within_its_bounds() -> None:
    assert reserve_horizon(25) == pytest.approx(0.04)
    assert reserve_horizon(4) == RESERVE_HORIZON_S  # 0.25 s: one interval, the cap
    assert reserve_horizon(0.5) == RESERVE_HORIZON_S
    assert reserve_horizon(10_000) == pytest.approx(0.01)  # the floor


def test_a_free_token_is_taken_without_sleeping(pacer, redis, clock) -> None:
    redis.bucket = [(True, 0.0)]
    assert pacer.take(LIMITS, deadline=clock.now + 10) == 100.0  # the reserved start
    assert clock.sleeps == []
    assert redis.calls == [("bucket", HORIZON)]


def test_at_25_per_second_a_token_is_reserved_at_most_40_ms_ahead(pacer, redis, clock) -> None:
    """The tokens reserved ahead go before any request that arrives later: one interval."""
    redis.bucket = [(False, 0.3), (True, 0.02)]
    limits = Limits(rate=25, burst=25, max_concurrent=2)
    assert pacer.take(limits, deadline=clock.now + 10) == pytest.approx(100.02)
    assert [max_wait for _, max_wait in redis.calls] == [pytest.approx(0.04)] * 2
    assert clock.sleeps == [pytest.approx(0.3 - 0.02), 0.02]


def test_a_reserved_turn_is_slept_out_exactly(pacer, redis, clock) -> None:
    redis.bucket = [(True, 0.2)]
    pacer.take(LIMITS, deadline=clock.now + 10)
    assert clock.sleeps == [0.2]


def test_a_far_turn_is_asked_for_again_from_within_the_horizon(pacer, redis, clock) -> None:
    """Nothing is reserved far ahead: the caller sleeps until its turn is within reach."""
    redis.bucket = [(False, 1.0), (True, 0.1)]
    pacer.take(LIMITS, deadline=clock.now + 10)
    assert clock.sleeps == [pytest.approx(1.0 - HORIZON / 2), 0.1]
    assert [max_wait for _, max_wait in redis.calls] == [HORIZON] * 2


def test_a_turn_past_the_deadline_is_refused_at_once(pacer, redis, clock) -> None:
    redis.bucket = [(False, 3.0)]
    with pytest.raises(AcquireTimeout, match="rate limit"):
        pacer.take(LIMITS, deadline=clock.now + 2)
    assert clock.sleeps == []


def test_the_reservation_never_reaches_past_the_deadline(pacer, redis, clock) -> None:
    redis.bucket = [(False, 0.05), (True, 0.0)]
    pacer.take(LIMITS, deadline=clock.now + 0.1)
    assert redis.calls[0] == ("bucket", pytest.approx(0.1))
    # after the minimum back-off of 10 ms, 90 ms remain, and that is what is asked for
    assert clock.sleeps == [0.01]
    assert redis.calls[1] == ("bucket", pytest.approx(0.09))


def test_slot_first_then_token_and_the_slot_is_given_back(pacer, redis, clock) -> None:
    redis.slots = [False, False, True]
    redis.bucket = [(True, 0.0)]
    with pytest.raises(KeyError), pacer.create_slot(LIMITS, deadline=clock.now + 10):
        raise KeyError("the create failed")
    kinds = [kind for kind, _ in redis.calls]
    assert kinds == ["slot", "slot", "slot", "bucket", "release"]
    assert len(clock.sleeps) == 2 and all(0.02 <= s <= 0.05 for s in clock.sleeps)
    member = redis.calls[0][1]
    assert redis.calls[-1] == ("release", member)


def test_no_slot_before_the_deadline_is_a_timeout_and_takes_no_token(pacer, redis, clock) -> None:
    redis.slots = [False] * 1000
    with (
        pytest.raises(AcquireTimeout, match="concurrent-create cap"),
        pacer.create_slot(LIMITS, deadline=clock.now + 1.0),
    ):
        pytest.fail("the block ran without a slot")
    assert "bucket" not in {kind for kind, _ in redis.calls}
    assert 1.0 <= sum(clock.sleeps) <= 1.05  # it kept trying until the deadline, no longer
