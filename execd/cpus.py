"""A task's visible CPUs, delivered rather than only checked.

When the sandbox's environment carries ``SANDMAN_EXECD_VISIBLE_CPUS=N`` (set by the
broker from a grading request's ``visible_cpus``; requests cannot set ``SANDMAN_*``
themselves), execd pins itself to the first N CPUs it may run on, before it starts any
thread or process. Affinity is inherited, so every bash (default and named sessions) and
every one-shot run then sees exactly N CPUs in ``os.sched_getaffinity`` (and in
``nproc``), as the task declared. Asking for more CPUs than execd may use leaves the
affinity alone and logs it: the grader's probe reports the contradiction.
"""

from __future__ import annotations

import os

from . import logs

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import List, Mapping, Optional

ENV = "SANDMAN_EXECD_VISIBLE_CPUS"

log = logs.getLogger("execd.cpus")


def pin_visible_cpus(environ: Mapping[str, str]) -> Optional[List[int]]:
    """Pin this process to the first N allowed CPUs; the CPUs chosen, or None if not
    asked (or not possible). Call it before any thread starts: on Linux the affinity
    of pid 0 is the calling thread's, and threads and children inherit it."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit("execd: %s must be a positive integer, not %r" % (ENV, raw))
    want = int(raw)
    if not hasattr(os, "sched_setaffinity"):
        log.warning("%s=%d: this platform has no CPU affinity; not applied", ENV, want)
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if want > len(allowed):
        log.warning(
            "%s=%d but only %d CPUs are allowed here: affinity left as is",
            ENV,
            want,
            len(allowed),
        )
        return None
    chosen = allowed[:want]
    os.sched_setaffinity(0, chosen)
    log.info("pinned to CPUs %s (%s=%d)", chosen, ENV, want)
    return chosen
