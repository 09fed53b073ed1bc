"""Failure attribution end to end against real execds (direct mode).

This machine has no outside network (the probe observes egress ``denied``), so a test
that fetches a URL fails with a real resolver error, which must be attributed to egress;
a test command killed by SIGKILL is attributed to ``oom``; a plain wrong fix to nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from broker.grading import Grader, Verdict
from broker.grading.spec import TaskSpec
from tests.integration.grading import test_grading_execd as execd_tests
from tests.integration.grading.test_grading_execd import (
    FAST,
    SWE,
    LocalGradingSandboxes,
    local,
)
from tests.support.tampering import make_test_patch

pytestmark = pytest.mark.integration

template = execd_tests.template
NET_TEST = """\
import unittest
import urllib.request


class NetTests(unittest.TestCase):
    def test_fetch(self):
        urllib.request.urlopen("https://example.com/", timeout=10).read()
"""


@pytest.fixture
def grading(template: Path, tmp_path: Path) -> LocalGradingSandboxes:
    return LocalGradingSandboxes(template, tmp_path / "grading" / "repo")


def network_task(grading: LocalGradingSandboxes, scratch: Path) -> TaskSpec:
    """The SWE demo plus a test patch adding a test that needs the network."""
    test_patch = make_test_patch(scratch / "net", {"tests/test_net.py": NET_TEST})
    return dataclasses.replace(
        local(SWE / "task.json", grading),
        test_command="python3 -m unittest -v tests.test_stats tests.test_net",
        test_patch=test_patch,
        test_files=("tests/test_stats.py", "tests/test_net.py"),
        fail_to_pass=("tests.test_stats.MedianTests.test_median_even",),
        pass_to_pass=("tests.test_net.NetTests.test_fetch",),
    )


def test_reference_failing_on_denied_egress_is_attributed(
    grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    task = network_task(grading, tmp_path)
    result = Grader(grading, FAST).grade(task, task.reference_patch)
    assert result.probe is not None
    assert result.probe["observed"]["egress"]["state"] == "denied"
    assert result.verdict is Verdict.UNRESOLVED and result.reward == 0.0
    assert result.pass_to_pass["tests.test_net.NetTests.test_fetch"] == "error"
    assert result.attribution == ["egress"], result.output_tail


def test_sigkilled_test_run_is_attributed_to_oom_and_wrong_fix_to_nothing(
    grading: LocalGradingSandboxes,
) -> None:
    task = local(SWE / "task.json", grading)
    killed = dataclasses.replace(
        task,
        test_command=task.test_command
        + '; python3 -c "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"',
    )
    result = Grader(grading, FAST).grade(killed, b"")
    assert result.verdict is Verdict.UNRESOLVED
    assert result.test_exit_code == 137
    assert result.attribution == ["oom"]
    wrong = Grader(grading, FAST).grade(task, (SWE / "specs" / "wrong.patch").read_bytes())
    assert wrong.verdict is Verdict.UNRESOLVED and wrong.attribution == []
