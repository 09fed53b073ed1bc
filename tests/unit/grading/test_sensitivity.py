"""Load-bearing conditions (issue #16 item 2) at the grading seam: the perturbations
chosen for a task's declared conditions, and how flipped verdicts become
``load_bearing`` / ``undeclared_dependency``. The grading itself is a fake ``grade``
callable that plays a task depending on one condition; the real runs are in
tests/integration/grading/test_grading_sensitivity.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from broker.grading.probe import decide, posix_offset_s
from broker.grading.results import GradeResult, Verdict
from broker.grading.sensitivity import analyse, perturbations, try_egress
from broker.grading.spec import Conditions, TaskSpec, load_task

pytestmark = pytest.mark.unit

SWE = Path(__file__).resolve().parents[3] / "deploy" / "images" / "swe-task"
TEST = "tests.test_stats.MedianTests.test_median_even"


def refuse(_state: str) -> str | None:
    return "this runner cannot change egress"


def _task(**conditions: object) -> TaskSpec:
    return replace(load_task(SWE / "task.json"), conditions=Conditions(**conditions))  # type: ignore[arg-type]


def _result(task: TaskSpec, ok: bool, egress: str = "denied") -> GradeResult:
    return GradeResult(
        task.task_id,
        Verdict.RESOLVED if ok else Verdict.UNRESOLVED,
        "" if ok else "FAIL_TO_PASS failing",
        fail_to_pass={TEST: "passed" if ok else "failed"},
        probe={"observed": {"egress": {"state": egress}}},
    )


def _keys(task: TaskSpec) -> list[tuple[str, str, bool]]:
    return [
        (p.key, p.value, p.conditions is not None)
        for p in perturbations(task.conditions, "denied", refuse)
    ]


def test_perturbations_for_undeclared_and_declared_conditions() -> None:
    assert _keys(_task()) == [
        ("pythonhashseed", "0", True),
        ("pythonhashseed", "1", True),
        ("pythonhashseed", "4242", True),
        ("tz", "IST-5:30", True),
        ("visible_cpus", "1", True),
        ("egress", "allowed", False),
    ]
    declared = _task(pythonhashseed="0", tz="IST-5:30", visible_cpus=1, min_cpus=2.0)
    assert _keys(declared)[:5] == [
        ("pythonhashseed", "1", True),
        ("pythonhashseed", "4242", True),
        ("pythonhashseed", "unset", True),
        ("tz", "UTC", True),
        ("visible_cpus", "1", False),  # declared 1 already
    ]
    one = perturbations(Conditions(visible_cpus=2, min_cpus=2.0), None, refuse)
    cpus = next(p for p in one if p.key == "visible_cpus")
    assert cpus.conditions == Conditions(visible_cpus=1)  # min_cpus would contradict it
    egress = next(p for p in one if p.key == "egress")
    assert egress.conditions is None and "unknown" in egress.reason


def test_egress_is_perturbed_only_where_the_sandbox_can_get_it() -> None:
    granted = perturbations(Conditions(egress="denied"), None, lambda _state: None)
    assert [(p.value, p.conditions) for p in granted if p.key == "egress"] == [
        ("allowed", Conditions(egress="allowed"))
    ]
    refused = perturbations(Conditions(egress="denied"), None, refuse)
    (egress,) = [p for p in refused if p.key == "egress"]
    assert egress.conditions is None and "egress" in egress.reason


@pytest.mark.parametrize(
    ("declared", "depends", "load_bearing", "undeclared"),
    [
        ({"pythonhashseed": "0"}, lambda c: c.pythonhashseed == "0", ["pythonhashseed"], []),
        ({}, lambda c: c.tz in (None, "UTC"), ["tz"], ["tz"]),
        ({"visible_cpus": 2}, lambda c: c.visible_cpus != 1, ["visible_cpus"], []),
        ({"tz": "UTC"}, lambda _c: True, [], []),  # depends on nothing: no false flag
    ],
)
def test_flipped_verdicts_make_a_condition_load_bearing(
    declared: dict[str, object], depends, load_bearing: list[str], undeclared: list[str]
) -> None:  # type: ignore[no-untyped-def]
    task = _task(**declared)
    graded: list[Conditions] = []

    def grade(spec: TaskSpec) -> GradeResult:
        graded.append(spec.conditions)
        return _result(spec, depends(spec.conditions))

    found = analyse(task, _result(task, depends(task.conditions)), grade, refuse)
    assert found.load_bearing == load_bearing
    assert found.undeclared_dependency == undeclared
    assert found.flipped_tests == {k: [TEST] for k in load_bearing}
    assert len(graded) == 5  # three seeds, one zone, one CPU; egress not tested
    statuses = sorted({(r.key, r.status) for r in found.runs})
    assert ("egress", "not_tested") in statuses


@pytest.mark.parametrize("kind", ["guard_missing", "egress_not_permitted", "probe_contradiction"])
def test_egress_the_broker_cannot_give_is_not_tested(kind: str) -> None:
    task = _task(egress="denied")

    def grade(spec: TaskSpec) -> GradeResult:
        if spec.conditions.egress == "allowed":
            return GradeResult(spec.task_id, Verdict.INFRA_ERROR, f"infra: {kind}", infra_kind=kind)
        return _result(spec, True)

    found = analyse(task, _result(task, True), grade, try_egress)
    (egress,) = [r for r in found.runs if r.key == "egress"]
    assert (egress.value, egress.status) == ("allowed", "not_tested")
    assert kind in egress.reason
    assert found.load_bearing == []


def test_egress_that_flips_the_reference_is_load_bearing() -> None:
    task = _task()  # undeclared; the probe observed egress denied

    def grade(spec: TaskSpec) -> GradeResult:
        return _result(spec, spec.conditions.egress != "allowed")  # a test that needs no network

    found = analyse(task, _result(task, True), grade, try_egress)
    assert found.load_bearing == ["egress"] and found.undeclared_dependency == ["egress"]


def test_infra_errors_are_not_flips() -> None:
    task = _task(pythonhashseed="0")

    def grade(spec: TaskSpec) -> GradeResult:
        return GradeResult(
            spec.task_id, Verdict.INFRA_ERROR, "infrastructure: lost", infra_kind="sandbox_lost"
        )

    found = analyse(task, _result(task, True), grade)
    assert found.load_bearing == []
    assert {r.status for r in found.runs} == {"infra_error"}  # egress included: not a refusal


@pytest.mark.parametrize(
    ("tz", "offset"),
    [("IST-5:30", 19800), ("JST-9", 32400), ("EST5", -18000), ("<+0530>-5:30", 19800)],
)
def test_posix_tz_needs_no_zone_data(tz: str, offset: int) -> None:
    assert posix_offset_s(tz) == offset
    obs = {"tz": {"env": tz, "utcoffset_s": offset, "expected_offset_s": None, "zone_error": "x"}}
    (check,) = [c for c in decide(Conditions(tz=tz), obs, grader_timeout_s=None) if c.field == "tz"]
    assert check.status == "ok", check.detail
    wrong = {"tz": {**obs["tz"], "utcoffset_s": 0}}  # glibc fell back to UTC
    (bad,) = [c for c in decide(Conditions(tz=tz), wrong, grader_timeout_s=None) if c.field == "tz"]
    assert bad.status == "contradiction"


def test_zone_names_and_dst_rules_are_not_posix_offsets() -> None:
    assert [posix_offset_s(z) for z in ("Asia/Kolkata", "EST5EDT", "UTC", "FOO")] == [None] * 4
