"""Named crash points: the same process exit a SIGKILL gives, at a chosen line of code.

A fault campaign or a regression test arms points with ``SANDMAN_FAILPOINT`` (read into
``Settings.failpoint``; a comma-separated list of names). A process that reaches an armed
point ends at once with ``os._exit(EXIT_CODE)``: no ``finally`` blocks, no atexit hooks,
no flushed buffers, no Celery ack, exactly like a worker killed at that instant. Killing
a worker from outside can only hit a window by luck; a failpoint hits it every time.

Production leaves the setting empty and every point is a no-op. The points:

  after-intent            the intent row is committed, no create was sent
  after-creating-commit   the row is ``creating``, no create was sent
  after-sandbox-start     local backend: the sandbox process runs, the creator has not
                          yet read its pid (the window of issue 20 item 1)
  after-uplink-start      local backend: the sandbox's egress uplink (slirp4netns) runs,
                          execd is still held back by bubblewrap (issue 20 item 5)
  after-create-sent       the create returned, readiness not awaited
  before-ready-commit     the sandbox answers, the row is not ``ready`` yet
  after-releasing-commit  the row is ``releasing``, no delete was sent
  after-delete-sent       the delete was sent, not confirmed
  snapshot-between-blobs  a capture stored its first blob, more to go; the row ``capturing``
  snapshot-after-blobs    a capture stored its blobs, no manifest, the row ``capturing``
  restore-after-prepare   a restore's sandbox was prepared, no file written yet
  restore-mid-put         a restore's put pack sent its first file, the rest unsent (execd
                          holds a half-read body and a half-restored tree)
  restore-mid-copy        local backend: a restore linked its blobs into the sandbox's
                          inbox, execd was not asked to copy them (links left behind)
"""

from __future__ import annotations

import os
from collections.abc import Callable

from broker.errors import ConfigError

POINTS = (
    "after-intent",
    "after-creating-commit",
    "after-sandbox-start",
    "after-uplink-start",
    "after-create-sent",
    "before-ready-commit",
    "after-releasing-commit",
    "after-delete-sent",
    "snapshot-between-blobs",
    "snapshot-after-blobs",
    "restore-after-prepare",
    "restore-mid-put",
    "restore-mid-copy",
)
EXIT_CODE = 86  # recognisable in a supervisor's log: "exit code 86" is a failpoint


def off(name: str) -> None:
    """The production failpoint: nothing happens."""


def armed(spec: str) -> Callable[[str], None]:
    """The failpoint function for ``spec`` (``SANDMAN_FAILPOINT``): ``off`` when empty.

    Unknown names are refused here, at start, so a typo cannot silently arm nothing."""
    names = frozenset(n.strip() for n in spec.split(",") if n.strip())
    if not names:
        return off
    unknown = sorted(names - set(POINTS))
    if unknown:
        raise ConfigError(f"unknown failpoint(s) {unknown}; known: {', '.join(POINTS)}")

    def hit(name: str) -> None:
        if name in names:
            os._exit(EXIT_CODE)

    return hit
