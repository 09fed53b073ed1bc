"""Clocks for code that takes one (``broker.pacing.Clock``): virtual and recording.

A test that checks *when* code waits should not wait: ``FakeClock`` moves time only when
the code under test sleeps. Where the other side keeps real time (Redis ``TIME`` in the
integration tests), ``RecordingClock`` sleeps for real and keeps the list of sleeps, so a
test can assert how long the code chose to wait instead of timing the machine.
"""

from __future__ import annotations

from broker.pacing import SystemClock


class FakeClock:
    """Virtual monotonic time that advances only by ``sleep`` (and ``advance``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, f"negative sleep {seconds}"
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingClock(SystemClock):
    """The real clock, remembering every sleep the code under test asked for."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)
