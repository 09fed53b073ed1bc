"""Why a graded run failed, when the cause is a run condition and not the patch.

A failed grading is still a verdict on the patch (``unresolved``, reward 0.0) under the
conditions the task declares; ``attribution`` tells a trainer (and preflight) which
condition the failure shows, so a reference that fails because egress is denied is not
read as a broken task, and a candidate killed by the OOM killer is not read as a bad fix.
Kinds:

- ``egress``: the test output shows network refusal (DNS failure, connection refused or
  reset, network unreachable, no route) while egress is denied (declared ``denied``, or
  observed denied by the probe). Output alone is not enough: with egress allowed a
  refused connection is the test's own business.
- ``timeout``: the test command hit the grader's timeout.
- ``oom``: the cgroup's ``oom_kill`` counter rose during the test run, or the test
  command died of SIGKILL (exit 137) without a timeout.
- ``probe_contradiction``: set on ``infra_error`` results whose sandbox contradicted the
  declared conditions (the only infrastructure kind that names a condition).

Other infrastructure failures stay ``infra_error`` with ``reward`` None and no attribution.
"""

from __future__ import annotations

import re

EGRESS = "egress"
TIMEOUT = "timeout"
OOM = "oom"
PROBE_CONTRADICTION = "probe_contradiction"
SIGKILL_EXIT = 137  # 128 + 9: what bash reports for a child killed by the OOM killer

# Messages from glibc/musl getaddrinfo, errno strings, urllib3/requests/httpx/aiohttp,
# pip, curl and git, as they appear in tracebacks and log lines.
NETWORK_REFUSAL = re.compile(
    r"|".join(
        (
            r"Temporary failure in name resolution",
            r"Name or service not known",
            r"No address associated with hostname",
            r"nodename nor servname provided",
            r"getaddrinfo failed",
            r"Name does not resolve",  # musl
            r"NameResolutionError",
            r"Failed to resolve '",
            r"Could not resolve host",
            r"Could not resolve proxy",
            r"\[Errno 111\]|Connection refused",
            r"\[Errno 104\]|Connection reset by peer",
            r"\[Errno 101\]|Network is unreachable",
            r"\[Errno 113\]|No route to host",
            r"Failed to establish a new connection",
            r"Failed to connect to \S+ port \d+",
            r"Cannot connect to host",
            r"Tunnel connection failed",
        )
    )
)


def shows_network_refusal(output: str) -> bool:
    return NETWORK_REFUSAL.search(output) is not None


def attribute(
    output: str,
    *,
    timed_out: bool,
    exit_code: int | None,
    oom_kills: int,
    egress_denied: bool,
) -> list[str]:
    """The condition kinds a failed test run shows (empty: the patch's own failure)."""
    kinds = []
    if timed_out:
        kinds.append(TIMEOUT)
    if oom_kills > 0 or (exit_code == SIGKILL_EXIT and not timed_out):
        kinds.append(OOM)
    if egress_denied and shows_network_refusal(output):
        kinds.append(EGRESS)
    return kinds
