"""The one polling helper for tests: wait for a condition, never for a fixed time.

A test that sleeps a fixed time is either slow or flaky; a test that polls with its own
loop repeats this one. ``timeout`` is a generous ceiling against hanging, not a claim
about speed: how fast something happens belongs in bench/.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.5, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail the test
    (saying ``what`` and the last value seen) when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(
                f"timed out after {timeout}s waiting for {what or predicate} (last={last!r})"
            )
        time.sleep(interval)
