"""execd's activity record (execd/activity.py) without a server: the verdict's rules."""

from __future__ import annotations

import pytest

from execd import errors
from execd.activity import Activity, Tracked
from tests.support.wait import wait_until

pytestmark = pytest.mark.unit


def test_a_running_call_is_never_reclaimed_and_status_paths_do_not_count() -> None:
    a = Activity()
    assert a.begin("/v1/exec") is True
    busy = a.reclaim(1e-6, 1e9)
    assert busy["reclaimed"] is False and busy["running"] == 1
    assert a.begin("/v1/info") is False and a.begin("/v1/heartbeat") is False
    a.end()
    assert wait_until(lambda: a.reclaim(1e-6, 1e9)["reclaimed"], what="the reclaim")


def test_after_the_reclaim_every_call_is_refused_but_the_question() -> None:
    a = Activity()
    wait_until(lambda: a.reclaim(1e-6, 1e9)["reclaimed"], what="the reclaim")
    for path in ("/v1/exec", "/v1/info", "/v1/heartbeat"):
        with pytest.raises(errors.Gone) as info:
            a.begin(path)
        assert info.value.status == 410 and info.value.code == "reclaimed"
    assert a.begin("/v1/reclaim") is False


def test_the_hand_out_caps_the_idle_time() -> None:
    a = Activity()
    wait_until(lambda: a.reclaim(1e9, 1e9)["idle_s"] > 0.01, what="some idleness")
    assert a.reclaim(1e-6, 0.0) == {"reclaimed": False, "idle_s": 0.0, "running": 0}


def test_a_tracked_stream_ends_its_call_once() -> None:
    ended: list[int] = []
    t = Tracked([b"a", b"b"], lambda: ended.append(1))
    assert next(t) == b"a"
    t.close()
    t.close()
    assert ended == [1]
    t2 = Tracked([b"a"], lambda: ended.append(2))
    assert list(t2) == [b"a"] and ended == [1, 2]
