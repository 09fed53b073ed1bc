"""Failure attribution over realistic runner output, and through the grader (fake seam)."""

from __future__ import annotations

import dataclasses

import pytest

from broker.grading.attribution import attribute, shows_network_refusal
from broker.grading.grade import GradeConfig, Grader
from broker.grading.preflight import PreflightEntry, markdown, preflight_task
from broker.grading.results import Verdict
from broker.grading.spec import load_task
from tests.unit.grading.test_grader import BAD_RUN, GOOD_RUN, SWE, FakeAcquire, observed

pytestmark = pytest.mark.unit

PYTEST_REQUESTS = """\
tests/test_fetch.py::test_fetch_index FAILED                                 [ 50%]
=================================== FAILURES ===================================
_______________________________ test_fetch_index _______________________________
    def test_fetch_index():
>       r = requests.get("https://pypi.org/simple/")
E       requests.exceptions.ConnectionError: HTTPSConnectionPool(host='pypi.org', port=443): \
Max retries exceeded with url: /simple/ (Caused by NameResolutionError("<urllib3.connection.\
HTTPSConnection object at 0x7f3a2c1b5e10>: Failed to resolve 'pypi.org' ([Errno -3] Temporary \
failure in name resolution)"))
FAILED tests/test_fetch.py::test_fetch_index - requests.exceptions.ConnectionError: ...
"""
OLD_URLLIB3 = """\
E   urllib3.exceptions.MaxRetryError: HTTPConnectionPool(host='example.com', port=80): Max \
retries exceeded with url: / (Caused by NewConnectionError('<urllib3.connection.HTTPConnection \
object at 0x7f>: Failed to establish a new connection: [Errno -2] Name or service not known'))
"""
URLLIB = """\
ERROR: test_download (tests.test_io.DownloadTests.test_download)
Traceback (most recent call last):
  File "/usr/lib/python3.12/urllib/request.py", line 1344, in do_open
    h.request(req.get_method(), req.selector, req.data, headers,
socket.gaierror: [Errno -3] Temporary failure in name resolution

During handling of the above exception, another exception occurred:
urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>
"""
REFUSED = "ConnectionRefusedError: [Errno 111] Connection refused\n"
RESET = "ConnectionResetError: [Errno 104] Connection reset by peer\n"
UNREACHABLE = "OSError: [Errno 101] Network is unreachable\n"
PIP = """\
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after \
connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection \
object at 0x7f0c8d1e2a50>: Failed to establish a new connection: [Errno -3] Temporary failure \
in name resolution')': /simple/numpy/
ERROR: Could not find a version that satisfies the requirement numpy (from versions: none)
ERROR: No matching distribution found for numpy
"""
CURL = "curl: (6) Could not resolve host: example.com\n"
HTTPX = "httpx.ConnectError: [Errno -2] Name or service not known\n"
PLAIN_FAILURE = """\
FAIL: test_median_even (tests.test_stats.MedianTests.test_median_even)
AssertionError: 3 != 2.5
"""


@pytest.mark.parametrize(
    "output",
    [PYTEST_REQUESTS, OLD_URLLIB3, URLLIB, REFUSED, RESET, UNREACHABLE, PIP, CURL, HTTPX],
    ids=[
        "requests",
        "urllib3",
        "urllib",
        "refused",
        "reset",
        "unreachable",
        "pip",
        "curl",
        "httpx",
    ],
)
def test_network_refusal_samples(output: str) -> None:
    assert shows_network_refusal(output)
    assert attribute(output, timed_out=False, exit_code=1, oom_kills=0, egress_denied=True) == [
        "egress"
    ]
    # with egress allowed, a refused connection is the test's business
    assert attribute(output, timed_out=False, exit_code=1, oom_kills=0, egress_denied=False) == []


def test_other_kinds() -> None:
    assert not shows_network_refusal(PLAIN_FAILURE + GOOD_RUN)
    none = attribute(PLAIN_FAILURE, timed_out=False, exit_code=1, oom_kills=0, egress_denied=True)
    assert none == []
    assert attribute("", timed_out=True, exit_code=137, oom_kills=0, egress_denied=True) == [
        "timeout"
    ]
    assert attribute(
        "Killed", timed_out=False, exit_code=137, oom_kills=0, egress_denied=False
    ) == ["oom"]
    assert attribute("", timed_out=False, exit_code=1, oom_kills=2, egress_denied=False) == ["oom"]


CFG = GradeConfig(max_attempts=2, retry_backoff_s=0)


def test_grader_attributes_egress_only_under_denied_egress() -> None:
    task = load_task(SWE / "task.json")  # declares no egress: the probe's observation decides
    run = BAD_RUN + URLLIB
    denied = Grader(FakeAcquire({"run": run}), CFG).grade(task, b"")
    assert denied.verdict is Verdict.UNRESOLVED and denied.reward == 0.0
    assert denied.attribution == ["egress"]
    allowed_obs = observed(egress={"state": "allowed", "reason": "verified TLS handshake"})
    allowed = Grader(FakeAcquire({"run": run, "observed": allowed_obs}), CFG).grade(task, b"")
    assert allowed.verdict is Verdict.UNRESOLVED and allowed.attribution == []
    declared = dataclasses.replace(
        task, conditions=dataclasses.replace(task.conditions, egress="denied")
    )
    unreadable = observed(egress={})  # the probe could not tell; the declaration decides
    both = Grader(FakeAcquire({"run": run, "observed": unreadable}), CFG).grade(declared, b"")
    assert both.attribution == ["egress"]
    ok = Grader(FakeAcquire({"run": GOOD_RUN + URLLIB}), CFG).grade(task, b"")
    assert ok.verdict is Verdict.RESOLVED and ok.attribution == []  # only failures


def test_grader_attributes_timeout_oom_and_probe_contradiction() -> None:
    task = load_task(SWE / "task.json")
    timed = Grader(FakeAcquire({"run": GOOD_RUN, "timed_out": True}), CFG).grade(task, b"")
    assert timed.attribution == ["timeout"]
    oom = Grader(FakeAcquire({"run": BAD_RUN, "oom_after": 1}), CFG).grade(task, b"")
    assert oom.verdict is Verdict.UNRESOLVED and oom.attribution == ["oom"]
    killed = Grader(FakeAcquire({"run": BAD_RUN, "exit": 137}), CFG).grade(task, b"")
    assert killed.attribution == ["oom"]
    plain = Grader(FakeAcquire({"run": BAD_RUN}), CFG).grade(task, b"")
    assert plain.attribution == []
    spec = load_task(SWE / "specs" / "swebench-style.json")
    allowed = observed(egress={"state": "allowed", "reason": "verified TLS handshake"})
    refused = Grader(FakeAcquire({"observed": allowed}), CFG).grade(spec, spec.reference_patch)
    assert refused.verdict is Verdict.INFRA_ERROR and refused.reward is None
    assert refused.attribution == ["probe_contradiction"]
    lost = Grader(FakeAcquire({"lose_on_probe": True}), CFG).grade(task, b"")
    assert lost.verdict is Verdict.INFRA_ERROR and lost.attribution == []


def test_preflight_report_carries_attribution() -> None:
    task = load_task(SWE / "task.json")
    grader = Grader(FakeAcquire({"run": BAD_RUN + PIP}), CFG)
    entry: PreflightEntry = preflight_task(grader, task)
    assert entry.status == "reference_fails"
    assert entry.reference["attribution"] == ["egress"]
    text = markdown([entry], {}, {"reference_fails": 1})
    assert "attributed to: egress" in text
