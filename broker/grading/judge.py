"""From one test run's output to a verdict: the part of grading that reads the log.

Kept apart from the sandbox protocol (``broker.grading.grade``) so the exact decision
the grader makes can be checked against other graders on real logs (the differential
tests against the official SWE-bench package, docs/grading.md).

Rules, in order:
1. a run that hit the grader's timeout is ``unresolved``;
2. a run with no parseable per-test result is ``unresolved``;
3. a run whose test command exited non-zero while its output reports no failing test
   (no failed, error or unexpected success) is ``unresolved``: the log does not
   describe the run that happened (the code under test can print fake status lines,
   e.g. from an ``atexit`` hook after the runner's summary). SWE-bench's
   ``get_logs_eval`` applies the same cross-check;
4. otherwise ``resolved`` iff every FAIL_TO_PASS and PASS_TO_PASS test passed or
   failed as expected (``testlog.PASSING``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.grading import testlog
from broker.grading.results import Verdict

# Outcomes whose presence explains a non-zero exit of the test command.
FAILING = frozenset({"failed", "error", "xpass"})


@dataclass(frozen=True)
class Judgement:
    outcomes: dict[str, str]  # every parsed test -> outcome
    fail_to_pass: dict[str, str]  # the task's names -> outcome (or "missing")
    pass_to_pass: dict[str, str]
    verdict: Verdict
    reason: str


def judge(  # noqa: PLR0917
    output: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    runner: str = "auto",
    exit_code: int = 0,
    timed_out: bool = False,
    timeout: float = 0.0,
) -> Judgement:
    """The verdict on one test run's combined output (``runner`` as in the task spec)."""
    outcomes = testlog.parse_output(output, runner)
    f2p = {n: testlog.lookup(outcomes, n) for n in fail_to_pass}
    p2p = {n: testlog.lookup(outcomes, n) for n in pass_to_pass}
    verdict, reason = _verdict(f2p, p2p, timed_out, timeout, outcomes, exit_code)
    return Judgement(outcomes, f2p, p2p, verdict, reason)


def _verdict(  # noqa: PLR0917
    f2p: dict[str, str],
    p2p: dict[str, str],
    timed_out: bool,
    timeout: float,
    outcomes: dict[str, str],
    exit_code: int,
) -> tuple[Verdict, str]:
    if timed_out:
        return Verdict.UNRESOLVED, f"tests timed out after {timeout:g}s"
    if not outcomes:
        return Verdict.UNRESOLVED, f"no test results in the output (exit {exit_code})"
    if exit_code != 0 and not FAILING.intersection(outcomes.values()):
        return Verdict.UNRESOLVED, (
            f"the test command exited {exit_code} but its output reports no failing test: "
            "the log does not describe the run"
        )
    bad_f = sorted(n for n, s in f2p.items() if s not in testlog.PASSING)
    bad_p = sorted(n for n, s in p2p.items() if s not in testlog.PASSING)
    if not bad_f and not bad_p:
        return Verdict.RESOLVED, "all FAIL_TO_PASS and PASS_TO_PASS pass"
    parts = []
    if bad_f:
        parts.append(f"FAIL_TO_PASS not passing: {', '.join(f'{n}={f2p[n]}' for n in bad_f)}")
    if bad_p:
        parts.append(f"PASS_TO_PASS broken: {', '.join(f'{n}={p2p[n]}' for n in bad_p)}")
    return Verdict.UNRESOLVED, "; ".join(parts)
