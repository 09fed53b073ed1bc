"""The test-path rule, and tampering patches built with real git that it must drop.

Each tampering kind is made in a throw-away copy of the SWE demo repository with git
itself (new files, deletions, mode changes, renames), next to a change of the code under
test; the broker-side filter must drop exactly the tampering paths and keep the code.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from broker.grading.grade import numstat_paths
from broker.grading.patch import is_excluded
from broker.grading.patchfmt import filter_patch, patch_paths
from broker.grading.spec import TaskSpecError, load_task, parse_task
from broker.grading.testrules import command_files, is_test_path
from tests.support.tampering import (
    SWE,
    TAMPERING,
    agent_patch,
    every_kind,
    git,
    hidden_section,
    make_base_repo,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "path",
    [
        "tests/__init__.py",
        "tests/data/fixture.json",
        "pkg/test/helpers.py",
        "test_x.py",
        "pkg/sub/test_thing.py",
        "pkg/thing_test.py",
        "conftest.py",
        "pkg/conftest.py",
        "sitecustomize.py",
        "lib/usercustomize.py",
        "evil.pth",
        "src/pkg/x.pth",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sub/pyproject.toml",
        "noxfile.py",
        ".coveragerc",
        "pkg/__pycache__/x.cpython-312.pyc",
        ".git/config",
    ],
)
def test_test_paths_by_rule(path: str) -> None:
    assert is_test_path(path)


@pytest.mark.parametrize(
    "path",
    [
        "statlib/stats.py",
        "pkg/testing.py",  # "test" only as part of a name
        "pkg/contest.py",
        "pkg/latest/x.py",
        "testsuite/x.py",  # not exactly tests/ or test/
        "README.md",
        "setup.py",
        "pkg/test_data.json",  # test_*.py only
        "tests",  # a file called "tests" at the root has no tests/ directory part
    ],
)
def test_code_paths_are_not_test_paths(path: str) -> None:
    assert not is_test_path(path)


def test_declared_files_command_files_excludes_and_allow() -> None:
    assert is_test_path("statlib/fixtures.py", test_files=["statlib/fixtures.py"])
    assert command_files("bash ./run_checks && python3 bin/check.py x/y.py::T::t -k 'a b'") == [
        "run_checks",
        "bin/check.py",
        "x/y.py",
    ]
    assert command_files("python3 -m unittest -v tests.test_stats --opt=a/b.py /abs/x.py") == []
    assert is_test_path("run_checks", test_command="./run_checks")
    assert is_test_path("docs/x.md", exclude_paths=["docs/**"])
    assert not is_test_path("pyproject.toml", allow_paths=["pyproject.toml"])
    assert not is_test_path("django/test/utils.py", allow_paths=["django/test/**"])
    # .git and by-products stay dropped whatever a task allows
    assert is_test_path(".git/hooks/pre-commit", allow_paths=["**"])
    assert is_test_path("a/__pycache__/b.pyc", allow_paths=["**"])


def _doc(**extra: object) -> dict[str, object]:
    return {
        "task_id": "t",
        "image": "localhost/x:v1",
        "base_commit": "0" * 40,
        "test_command": "true",
        "FAIL_TO_PASS": ["a"],
        "test_files": ["tests/test_a.py"],
        **extra,
    }


def test_allow_paths_is_validated() -> None:
    assert parse_task(_doc(allow_paths=["pyproject.toml"])).allow_paths == ("pyproject.toml",)
    with pytest.raises(TaskSpecError) as info:
        parse_task(_doc(allow_paths=["tests/**", "/abs", "../up", ".git/x", 3]))
    paths = sorted(i.path for i in info.value.issues)
    assert paths == [
        "$.allow_paths[0]",
        "$.allow_paths[1]",
        "$.allow_paths[1]",  # the schema's pattern and the relative-path check
        "$.allow_paths[2]",
        "$.allow_paths[3]",
        "$.allow_paths[4]",
    ]
    assert any("matches test file 'tests/test_a.py'" in str(i) for i in info.value.issues)


# --- tampering patches, made by git ------------------------------------------------


@pytest.fixture(scope="module")
def base_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base_repo(tmp_path_factory.mktemp("rules") / "repo")


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_filter_drops_exactly_the_tampering(base_repo: Path, tmp_path: Path, kind: str) -> None:
    tamper, expected = TAMPERING[kind]
    task = load_task(SWE / "task.json")
    raw = agent_patch(base_repo, tmp_path, tamper)
    assert set(expected) <= set(patch_paths(raw)), patch_paths(raw)
    kept, dropped = filter_patch(raw, lambda p: is_excluded(task, p))
    assert sorted(dropped) == sorted(expected)
    assert patch_paths(kept) == ["statlib/stats.py"]
    if kind == "rename_into_tests":
        assert b"rename from README.md" in raw  # git really wrote a rename section
    # what is kept applies cleanly to the base on its own
    check = tmp_path / "check"
    shutil.copytree(base_repo, check, symlinks=True)
    (tmp_path / "kept.patch").write_bytes(kept)
    git(check, "apply", "--check", str(tmp_path / "kept.patch"))


def test_allow_paths_keeps_an_allowed_config_change(base_repo: Path, tmp_path: Path) -> None:
    tamper, _ = TAMPERING["pyproject"]
    task = dataclasses.replace(load_task(SWE / "task.json"), allow_paths=("pyproject.toml",))
    raw = agent_patch(base_repo, tmp_path, tamper)
    kept, dropped = filter_patch(raw, lambda p: is_excluded(task, p))
    assert dropped == []
    assert sorted(patch_paths(kept)) == ["pyproject.toml", "statlib/stats.py"]


def test_every_kind_in_one_patch(base_repo: Path, tmp_path: Path) -> None:
    tamper, expected = every_kind()
    task = load_task(SWE / "task.json")
    kept, dropped = filter_patch(
        agent_patch(base_repo, tmp_path, tamper), lambda p: is_excluded(task, p)
    )
    assert sorted(dropped) == expected
    assert patch_paths(kept) == ["statlib/stats.py"]


def test_a_file_patch_hidden_after_the_hunks_is_seen_and_dropped(
    base_repo: Path, tmp_path: Path
) -> None:
    """git apply takes a bare ---/+++ pair inside a diff --git section as another file."""
    patch = hidden_section()
    (tmp_path / "hidden.patch").write_bytes(patch)
    seen_by_git = numstat_paths(
        git(base_repo, "apply", "--numstat", "-z", str(tmp_path / "hidden.patch"))
    )
    assert seen_by_git == ["statlib/stats.py", "tests/__init__.py"]
    assert set(seen_by_git) <= set(patch_paths(patch))
    task = load_task(SWE / "task.json")
    kept, dropped = filter_patch(patch, lambda p: is_excluded(task, p))
    assert kept == b"" and sorted(dropped) == ["statlib/stats.py", "tests/__init__.py"]


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_the_parse_sees_every_path_git_apply_touches(
    base_repo: Path, tmp_path: Path, kind: str
) -> None:
    raw = agent_patch(base_repo, tmp_path, TAMPERING[kind][0])
    (tmp_path / "agent.patch").write_bytes(raw)
    seen_by_git = numstat_paths(
        git(base_repo, "apply", "--numstat", "-z", str(tmp_path / "agent.patch"))
    )
    assert "statlib/stats.py" in seen_by_git
    assert set(seen_by_git) <= set(patch_paths(raw))  # git apply names a rename's new path


def test_grader_refuses_a_patch_git_reads_differently() -> None:
    """When the sandbox's git names a path the broker's parse did not, nothing is applied."""
    from broker.grading.grade import Grader
    from broker.grading.results import Verdict
    from tests.unit.grading.test_grader import CFG, FakeAcquire

    task = load_task(SWE / "task.json")
    fake = FakeAcquire({"numstat": b"1\t0\tstatlib/stats.py\x001\t0\ttests/__init__.py\x00"})
    result = Grader(fake, CFG).grade(task, task.reference_patch)
    assert result.verdict is Verdict.UNRESOLVED and result.reward == 0.0
    assert result.reason == "patch touches paths its file headers do not name: tests/__init__.py"
    assert "applies" not in fake.scripts[0]  # the apply script never ran
    agrees = FakeAcquire({"numstat": b"1\t0\tstatlib/stats.py\x00"})
    assert Grader(agrees, CFG).grade(task, task.reference_patch).verdict is Verdict.RESOLVED
