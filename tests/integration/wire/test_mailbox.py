"""The hand-over between a worker and a waiting trainer never strands a sandbox."""

from __future__ import annotations

import pytest
import redis

from broker.wire import mailbox

pytestmark = pytest.mark.integration


@pytest.fixture
def r(redis_url: str):  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/15")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def test_delivered_before_cancel_is_handed_to_the_trainer(r: redis.Redis) -> None:
    assert mailbox.deliver(r, "a", {"lease": {"sandbox_id": "s1"}})
    late = mailbox.cancel(r, "a")  # the trainer gave up just after: it still sees it
    assert late == {"lease": {"sandbox_id": "s1"}}


def test_cancel_before_delivery_makes_the_worker_release(r: redis.Redis) -> None:
    assert mailbox.cancel(r, "b") is None
    assert not mailbox.deliver(r, "b", {"lease": {"sandbox_id": "s2"}})
    assert mailbox.cancelled(r, "b")
    assert r.llen(mailbox.result_key("b")) == 0


def test_results_expire(r: redis.Redis) -> None:
    mailbox.deliver(r, "c", {"error": {"code": "x"}})
    assert 0 < r.ttl(mailbox.result_key("c")) <= mailbox.RESULT_TTL_S
