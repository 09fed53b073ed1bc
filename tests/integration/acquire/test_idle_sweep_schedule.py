"""The idle sweeper sleeps until the earliest deadline, not a fixed second (real Redis).

Each sweep's claim script also answers the earliest deadline left, so a sandbox is
reclaimed as its deadline passes instead of up to a whole ``idle_sweep_s`` later; the
sleep is still capped, because a hand-out registered meanwhile may come due sooner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib

from broker.acquire.idle import BATCH, IdleReclaimer, SweepReport
from broker.names import IDLE_DEADLINES_KEY
from tests.integration.conftest import flushed_db

pytestmark = pytest.mark.integration
NOW = 1_000_000.0


@pytest.fixture
def reclaimer(redis_url: str, sessions: Any) -> Iterator[IdleReclaimer]:
    with flushed_db(redis_url, 13) as url:
        client = redis_lib.Redis.from_url(url)
        # Nothing comes due in these tests, so the provider and enqueue are never reached.
        yield IdleReclaimer(
            sessions,
            client,
            provider=None,  # type: ignore[arg-type]
            enqueue=lambda *_: None,
            clock=lambda: NOW,
        )
        client.close()


def test_a_sweep_answers_the_earliest_deadline_left(reclaimer: IdleReclaimer) -> None:
    assert reclaimer.sweep().next_due_at is None  # nothing registered
    reclaimer.register("held-long", 300.0, since=NOW)
    reclaimer.register("held-short", 4.25, since=NOW)
    report = reclaimer.sweep()
    assert (report.due, report.next_due_at) == (0, NOW + 4.25)
    assert reclaimer.redis.zscore(IDLE_DEADLINES_KEY, "held-short") == NOW + 4.25  # untouched


def test_the_sleep_is_until_the_deadline_capped_and_none_in_a_backlog() -> None:
    report = SweepReport(next_due_at=NOW + 0.25)
    assert report.sleep_s(NOW, 1.0) == 0.25
    assert report.sleep_s(NOW + 1.0, 1.0) == 0.0  # already due: at once, never negative
    assert SweepReport(next_due_at=NOW + 30).sleep_s(NOW, 1.0) == 1.0  # capped
    assert SweepReport().sleep_s(NOW, 1.0) == 1.0  # nothing registered
    assert SweepReport(due=BATCH, next_due_at=NOW + 30).sleep_s(NOW, 1.0) == 0.0
