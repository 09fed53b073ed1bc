"""Per-test outcomes from test-runner output: ``unittest -v`` and ``pytest -rA``.

Outcomes are one of passed, failed, error, skipped, xfail, xpass. A test counts as
passing when it passed or failed as expected (xfail), as in SWE-bench's harness; a
test that does not appear in the output did not pass.

Test names are matched loosely so task files can use any common spelling of the same
test: ``tests.test_stats.MeanTests.test_mean`` (dotted), ``test_mean
(tests.test_stats.MeanTests)`` (Django/SWE-bench unittest style) and
``tests/test_stats.py::MeanTests::test_mean`` (pytest node id) all name one test.
"""

from __future__ import annotations

import re

PASSING = frozenset({"passed", "xfail"})
_UT_HEAD = re.compile(r"^(?P<name>[A-Za-z_]\w*) \((?P<where>[\w.]+)\)(?P<rest>.*)$")
_UT_STATUS = {
    "ok": "passed",
    "FAIL": "failed",
    "ERROR": "error",
    "expected failure": "xfail",
    "unexpected success": "xpass",
}
_UT_TAIL = re.compile(
    r"(?:^|\.\.\. )(ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$"
)
_UT_SUMMARY = re.compile(r"^(FAIL|ERROR): (?P<name>[A-Za-z_]\w*) \((?P<where>[\w.]+)\)")
# pytest's status words are our outcome names in capitals.
_PY_STATUS = {
    word: word.lower() for word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
}
_PY_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (?P<rest>\S.*)$")
_PY_VERBOSE = re.compile(r"^(?P<id>\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _ut_id(name: str, where: str) -> str:
    return where if where.endswith("." + name) else f"{where}.{name}"


def parse_unittest(output: str) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    current: str | None = None
    for line in output.splitlines():
        summary = _UT_SUMMARY.match(line)
        if summary:
            test = _ut_id(summary["name"], summary["where"])
            outcomes[test] = "failed" if summary.group(1) == "FAIL" else "error"
            continue
        head = _UT_HEAD.match(line)
        text = line
        if head:
            current = _ut_id(head["name"], head["where"])
            text = head["rest"]
        if current is None:
            continue
        tail = _UT_TAIL.search(text.rstrip())
        if tail and current not in outcomes:
            word = tail.group(1)
            outcomes[current] = "skipped" if word.startswith("skipped") else _UT_STATUS[word]
            current = None
    return outcomes


def _summary_id(rest: str) -> str:
    """The node id at the start of a ``-rA`` summary line's remainder.

    pytest prints ``ID`` or ``ID - MESSAGE``. A parametrized id may itself contain
    spaces, brackets and ``" - "`` (``test_x[p - q]``, ``test_x[x[1]]``), so the id ends
    at the first ``]`` closing its parameters (brackets balanced, else the first
    candidate) that is followed by the end of the line or by ``" - "``.
    """
    head = rest.split(" ", 1)[0]
    if "[" not in head:
        return head
    start = rest.index("[")
    ends = [
        i + 1
        for i, char in enumerate(rest)
        if char == "]" and i > start and (i + 1 == len(rest) or rest.startswith(" - ", i + 1))
    ]
    balanced = [e for e in ends if rest.count("[", 0, e) == rest.count("]", 0, e)]
    return rest[: (balanced or ends or [len(head)])[0]]


def parse_pytest(output: str) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for raw in output.splitlines():
        line = raw.rstrip()
        summary = _PY_SUMMARY.match(line)
        verbose = None if summary else _PY_VERBOSE.match(line)
        if summary:
            test, status = _summary_id(summary["rest"]), summary.group(1)
        elif verbose:
            test, status = verbose["id"], verbose.group(2)
        else:
            continue
        if "::" in test or ".py" in test:
            outcomes[test] = _PY_STATUS[status]
    return outcomes


def parse_output(output: str, runner: str = "auto") -> dict[str, str]:
    if runner == "pytest":
        return parse_pytest(output)
    if runner == "unittest":
        return parse_unittest(output)
    return parse_pytest(output) or parse_unittest(output)


def aliases(name: str) -> list[str]:
    """Every spelling of one test name this module knows."""
    out = [name]
    ut = re.fullmatch(r"([A-Za-z_]\w*) \(([\w.]+)\)", name)
    if ut:
        out.append(_ut_id(ut.group(1), ut.group(2)))
    if "::" in name:
        path, *parts = name.split("::")
        module = re.sub(r"\.py$", "", path).replace("/", ".")
        out.append(".".join([module, *parts]))
    return out


def lookup(outcomes: dict[str, str], name: str) -> str:
    """The outcome of ``name``, or "missing" when the output never mentions it."""
    index = {alias: status for test, status in outcomes.items() for alias in aliases(test)}
    for alias in aliases(name):
        if alias in index:
            return index[alias]
    return "missing"
