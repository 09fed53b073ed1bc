"""Tampering patches and private grading paths, graded end to end in direct mode.

Grading sandboxes are real execd processes over fresh copies of the SWE demo repository
(see test_grading_execd.py); agent patches are made by git (tests/support/tampering.py).
They all share this machine's /tmp, which is what the private-path test relies on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client.sync import ExecResult
from broker.grading import Grader, Verdict, load_task
from broker.grading.direct import DirectSandbox
from broker.grading.grade import hidden_paths
from broker.grading.patchfmt import patch_paths
from broker.grading.seam import GradingSandbox, SandboxRequest
from broker.grading.spec import TaskSpec
from tests.integration.grading import test_grading_execd as execd_tests
from tests.integration.grading.test_grading_execd import (
    FAST,
    SWE,
    LocalGradingSandboxes,
    execd,
    local,
)
from tests.support.tampering import TAMPERING, agent_patch, hidden_section, make_base_repo

pytestmark = pytest.mark.integration


# The repository the grading sandboxes hold, at the task's exact base commit.
base = execd_tests.template


@pytest.fixture(scope="module")
def agent_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base_repo(tmp_path_factory.mktemp("tamper-agent") / "repo")


@pytest.fixture
def grading(base: Path, tmp_path: Path) -> LocalGradingSandboxes:
    return LocalGradingSandboxes(base, tmp_path / "grading" / "repo")


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_tampering_without_a_fix_is_unresolved(
    kind: str, agent_base: Path, grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    tamper, expected = TAMPERING[kind]
    task = local(SWE / "task.json", grading)
    result = Grader(grading, FAST).grade(task, agent_patch(agent_base, tmp_path, tamper))
    assert result.verdict is Verdict.UNRESOLVED, (result.reason, result.output_tail)
    assert result.reward == 0.0
    assert result.dropped_files == sorted(expected)
    assert result.patch_files == ["statlib/stats.py"]
    assert result.fail_to_pass["tests.test_stats.MedianTests.test_median_even"] == "failed"


def test_the_monkeypatch_really_works_when_a_task_allows_it(
    agent_base: Path, grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    """The control: the same tests/__init__.py patch, allowed, turns the verdict."""
    tamper, _ = TAMPERING["tests_init_monkeypatch"]
    task = dataclasses.replace(
        local(SWE / "task.json", grading), allow_paths=("tests/__init__.py",)
    )
    result = Grader(grading, FAST).grade(task, agent_patch(agent_base, tmp_path, tamper))
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
    assert result.dropped_files == []


def test_correct_fix_with_tampering_is_resolved_and_reports_the_drops(
    agent_base: Path, grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    tamper, expected = TAMPERING["pytest_ini"]
    task = local(SWE / "task.json", grading)
    result = Grader(grading, FAST).grade(task, agent_patch(agent_base, tmp_path, tamper, fix=True))
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
    assert result.dropped_files == expected
    assert not (grading.repo_path / "pytest.ini").exists()


def test_allowed_config_change_is_applied(
    agent_base: Path, grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    tamper, _ = TAMPERING["pyproject"]
    task = dataclasses.replace(local(SWE / "task.json", grading), allow_paths=("pyproject.toml",))
    result = Grader(grading, FAST).grade(task, agent_patch(agent_base, tmp_path, tamper, fix=True))
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
    assert result.dropped_files == []
    assert sorted(result.patch_files) == ["pyproject.toml", "statlib/stats.py"]
    assert (grading.repo_path / "pyproject.toml").exists()


class Interleaving:
    """Two gradings in two execds sharing /tmp, interleaved at the worst point: grading B
    runs from start to end after A has written its patches and before A applies them."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base = base
        self.root = root
        self.numbers = itertools.count()
        self.inner: list[tuple[Grader, TaskSpec, bytes]] = []
        self.inner_results: list[Verdict] = []
        self.work_dirs: list[str] = []

    @contextlib.contextmanager
    def __call__(self, request: SandboxRequest) -> Iterator[GradingSandbox]:
        repo = self.root / f"g{next(self.numbers)}" / "repo"
        shutil.copytree(self.base, repo, symlinks=True)
        with execd(repo, request.env) as sandbox:
            yield Paused(sandbox, self)

    def patches_written(self, work_dir: str) -> None:
        self.work_dirs.append(work_dir)
        while self.inner:  # A waits here while B grades completely
            grader, task, patch = self.inner.pop()
            self.inner_results.append(grader.grade(task, patch).verdict)


class Paused:
    """A DirectSandbox that hands control to ``Interleaving`` after the test patch lands."""

    def __init__(self, sandbox: DirectSandbox, interleaving: Interleaving) -> None:
        self.id = sandbox.id
        self.sandbox = sandbox
        self.interleaving = interleaving

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        return self.sandbox.exec(command, timeout=timeout, max_output_bytes=max_output_bytes)

    def read_file(self, path: str) -> bytes:
        return self.sandbox.read_file(path)

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        n = self.sandbox.write_file(path, content, mode=mode)
        if path.endswith("/test.patch"):
            self.interleaving.patches_written(path.rsplit("/", 1)[0])
        return n


def test_interleaved_gradings_sharing_tmp_do_not_cross_talk(base: Path, tmp_path: Path) -> None:
    interleaving = Interleaving(base, tmp_path / "shared")
    grader = Grader(interleaving, dataclasses.replace(FAST, max_attempts=1))
    task_b = dataclasses.replace(load_swe(), repo_path=str(tmp_path / "shared" / "g1" / "repo"))
    interleaving.inner.append((grader, task_b, b""))  # B: the empty patch, must fail
    task_a = dataclasses.replace(load_swe(), repo_path=str(tmp_path / "shared" / "g0" / "repo"))
    result_a = grader.grade(task_a, task_a.reference_patch)  # A: the fix, must pass
    assert interleaving.inner_results == [Verdict.UNRESOLVED]
    assert result_a.verdict is Verdict.RESOLVED, (result_a.reason, result_a.output_tail)
    # each grading had its own directory, and both are gone afterwards
    assert len(set(interleaving.work_dirs)) == 2, interleaving.work_dirs
    assert all(d.startswith("/tmp/sandman-grade.") for d in interleaving.work_dirs)
    assert not any(Path(d).exists() for d in interleaving.work_dirs)


def load_swe() -> TaskSpec:
    return load_task(SWE / "task.json")


def test_sandbox_git_reports_paths_the_broker_parse_missed(
    grading: LocalGradingSandboxes, tmp_path: Path
) -> None:
    """The second opinion: if the broker's parse ever misses a file patch that git
    applies (here: told it saw only statlib/stats.py), the grader refuses the patch."""
    patch = hidden_section()
    task = local(SWE / "task.json", grading)
    work = tmp_path / "work"
    work.mkdir()
    with grading(Grader(grading).request_for(task)) as sandbox:
        sandbox.write_file(f"{work}/agent.patch", patch)
        missed = hidden_paths(sandbox, task, str(work), patch, ["statlib/stats.py"])
        assert missed == ["tests/__init__.py"]
        assert hidden_paths(sandbox, task, str(work), patch, patch_paths(patch)) == []


def test_hidden_file_patch_is_dropped_with_its_section(grading: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", grading)
    result = Grader(grading, FAST).grade(task, hidden_section())
    assert result.verdict is Verdict.UNRESOLVED
    assert result.dropped_files == ["statlib/stats.py", "tests/__init__.py"]
    assert (grading.repo_path / "tests" / "__init__.py").read_text() == ""
