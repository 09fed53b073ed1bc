"""Tampering patches (and an OOM kill) graded through the broker on the local cluster.

Uses the grading stack of test_grading_cluster.py (a Celery worker with the Kubernetes
backend, one namespace). Each grading costs a pod, so every tampering kind travels in one
agent patch (tests/support/tampering.py builds it with git); the direct-mode tests in
tests/integration/grading/test_grading_tampering.py grade each kind on its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from broker.grading import Verdict, load_task
from tests.cluster import test_grading_cluster as cluster_grading
from tests.support.tampering import SWE, TAMPERING, agent_patch, every_kind, make_base_repo

pytestmark = pytest.mark.cluster

stack = cluster_grading.stack  # the module-scoped grading stack fixture


@pytest.fixture(scope="module")
def agent_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base_repo(tmp_path_factory.mktemp("tamper-agent") / "repo")


def test_tampering_is_dropped_and_unresolved(
    stack: dict[str, Any], agent_base: Path, tmp_path: Path
) -> None:
    task = load_task(SWE / "task.json")
    g = cluster_grading.grader(stack)
    tamper, expected = every_kind()
    result = g.grade(task, agent_patch(agent_base, tmp_path, tamper))
    assert result.verdict is Verdict.UNRESOLVED, (result.reason, result.attempts)
    assert result.reward == 0.0
    assert result.dropped_files == expected
    assert result.patch_files == ["statlib/stats.py"]
    assert result.fail_to_pass["tests.test_stats.MedianTests.test_median_even"] == "failed"


def test_allowed_monkeypatch_shows_the_hole_the_rule_closes(
    stack: dict[str, Any], agent_base: Path, tmp_path: Path
) -> None:
    tamper, _ = TAMPERING["tests_init_monkeypatch"]
    task = dataclasses.replace(load_task(SWE / "task.json"), allow_paths=("tests/__init__.py",))
    result = cluster_grading.grader(stack).grade(task, agent_patch(agent_base, tmp_path, tamper))
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
    assert result.dropped_files == []


def test_correct_fix_resolves_with_and_without_allow_paths(
    stack: dict[str, Any], agent_base: Path, tmp_path: Path
) -> None:
    task = load_task(SWE / "task.json")
    g = cluster_grading.grader(stack)
    tamper, _ = TAMPERING["pyproject"]
    patch = agent_patch(agent_base, tmp_path, tamper, fix=True)
    dropped = g.grade(task, patch)
    assert dropped.verdict is Verdict.RESOLVED, (dropped.reason, dropped.output_tail)
    assert dropped.dropped_files == ["pyproject.toml"]
    allowed = g.grade(dataclasses.replace(task, allow_paths=("pyproject.toml",)), patch)
    assert allowed.verdict is Verdict.RESOLVED, (allowed.reason, allowed.output_tail)
    assert allowed.dropped_files == []
    assert sorted(allowed.patch_files) == ["pyproject.toml", "statlib/stats.py"]


def test_cgroup_oom_kill_is_attributed(stack: dict[str, Any]) -> None:
    """A test run whose process the pod's memory limit kills (the grading pod has 512Mi)
    is attributed to ``oom`` from the cgroup's counter: the command's own exit is 1."""
    task = load_task(SWE / "task.json")
    hog = dataclasses.replace(
        task, test_command="python3 -c \"b = b'x' * (900 << 20)\"; echo after the kill; exit 1"
    )
    result = cluster_grading.grader(stack).grade(hog, task.reference_patch)
    assert result.verdict is Verdict.UNRESOLVED, (result.reason, result.attempts)
    assert result.test_exit_code == 1
    assert result.attribution == ["oom"], (result.output_tail, result.probe)
