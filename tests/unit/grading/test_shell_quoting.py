"""No spec value becomes a shell command (issue 20 item 11).

Two guards: ``sandman task validate`` refuses a repo_path outside a safe character set (so
a hostile spec never reaches a grader), and the scripts the grader builds quote whatever
reaches them anyway (a TaskSpec can be built in code, bypassing the file validation).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from broker.grading.grade import apply_script
from broker.grading.patch import extraction_script
from broker.grading.spec import TaskSpec, TaskSpecError, parse_task

from .test_spec import minimal

pytestmark = pytest.mark.unit

HOSTILE_REPO = '/repo"; touch /tmp/pwned; "'


@pytest.mark.parametrize(
    "repo_path",
    [
        HOSTILE_REPO,
        "/repo$(touch /tmp/pwned)",
        "/repo`id`",
        "/repo;id",
        "/repo with space",
        "/repo\n",
        "/repo\x00",
        "/repo/../etc",
        "/./repo",
        "relative/repo",
        "/" + "a" * 5000,
    ],
)
def test_validation_refuses_unsafe_repo_paths(repo_path: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        parse_task(minimal(repo_path=repo_path), source="t.json")
    assert any(i.path == "$.repo_path" for i in info.value.issues), info.value.issues


@pytest.mark.parametrize("repo_path", ["/repo", "/testbed", "/work/my-repo_2.0/src", "/a/b/"])
def test_ordinary_repo_paths_are_accepted(repo_path: str) -> None:
    assert parse_task(minimal(repo_path=repo_path)).repo_path == repo_path.rstrip("/")


@pytest.mark.parametrize("name", ["tests/a\nb.py", "tests/a\x00.py"])
def test_validation_refuses_test_files_with_line_breaks_or_nul(name: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        parse_task(minimal(test_files=[name]))
    assert any(i.path == "$.test_files[0]" for i in info.value.issues), info.value.issues


def test_task_validate_names_the_spec_path(tmp_path: Path) -> None:
    from broker.cli.main import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(minimal(repo_path=HOSTILE_REPO)))
    result = CliRunner().invoke(main, ["task", "validate", str(bad)])
    assert result.exit_code == 1
    assert "$.repo_path" in result.output and str(bad) in result.output


def _hostile_task(marker: Path) -> TaskSpec:
    task = parse_task(minimal())
    return replace(
        task,
        repo_path=f'/nonexistent-repo"; touch {marker}; "',
        test_files=(f"tests/$(touch {marker})", "tests/a'b.py"),
    )


def _unquoted_rest(script: str, values: list[str]) -> str:
    """The script with every shell-quoted occurrence of ``values`` removed."""
    for value in values:
        script = script.replace(shlex.quote(value), "")
    return script


def test_apply_script_quotes_every_spec_value(tmp_path: Path) -> None:
    task = _hostile_task(tmp_path / "pwned")
    script = apply_script(task, "/tmp/agent.patch", "/tmp/test.patch")
    rest = _unquoted_rest(script, [task.repo_path, *task.test_files])
    assert "touch" not in rest, rest


def test_extraction_script_quotes_every_spec_value(tmp_path: Path) -> None:
    task = _hostile_task(tmp_path / "pwned")
    script = extraction_script(task)
    specs = [":(exclude,literal)" + name for name in task.test_files]
    rest = _unquoted_rest(script, [task.repo_path, *specs])
    assert "touch" not in rest, rest


def test_running_the_apply_script_with_a_hostile_repo_path_runs_nothing(tmp_path: Path) -> None:
    """The real shell: the script stops at the missing repository, and nothing ran."""
    marker = tmp_path / "pwned"
    script = apply_script(_hostile_task(marker), "/nonexistent/a", "/nonexistent/t")
    result = subprocess.run(
        ["bash", "-c", f"( {script} )"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 10, result.stderr
    assert "no repository at /nonexistent-repo" in result.stderr
    assert not marker.exists()
