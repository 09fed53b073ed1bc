"""Harbor task directories (issue #16 item 6): loading task.toml into a TaskSpec, the
typed refusals (a Dockerfile-only task names the field to set), reward files, and which
paths the CLI reads as tasks. Grading itself runs in
tests/integration/grading/test_grading_harbor.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from broker.cli.grading import _task_files
from broker.grading.harbor import parse_reward, verifier_command
from broker.grading.spec import Conditions, TaskSpecError, load_task

pytestmark = pytest.mark.unit

HARBOR = Path(__file__).resolve().parents[3] / "deploy" / "images" / "swe-task" / "harbor"
EVEN = HARBOR / "median-even"


def test_a_harbor_directory_loads_as_a_task() -> None:
    task = load_task(EVEN)
    assert task.harbor is not None
    assert (task.task_id, task.image, task.repo_path) == (
        "sandman-demo/harbor-median-even",
        "localhost/sandman-swe-task:v1",
        "/repo",
    )
    assert task.conditions == Conditions(timeout_s=120.0, min_cpus=1.0, min_memory_b=512 << 20)
    assert [rel for rel, _, _ in task.harbor.tests] == ["test.sh", "test_median.py"]
    assert dict((r, m) for r, _, m in task.harbor.tests)["test.sh"] == 0o755
    assert [rel for rel, _, _ in task.harbor.solution] == ["solve.sh"]
    assert task.harbor.verifier_env == (("STATLIB_EXPECT", "2.5"),)
    assert task.harbor.agent_timeout_s == 600.0
    assert verifier_command(task, task.harbor) == (
        "cd /repo && env STATLIB_EXPECT=2.5 bash /tests/test.sh"
    )


def _copy(tmp_path: Path, toml: str | None = None) -> Path:
    root = tmp_path / "task"
    shutil.copytree(EVEN, root)
    if toml is not None:
        (root / "task.toml").write_text(toml)
    return root


def _issues(root: Path) -> dict[str, str]:
    with pytest.raises(TaskSpecError) as info:
        load_task(root)
    return {i.path: i.message for i in info.value.issues}


def test_a_dockerfile_only_task_is_refused_naming_the_field(tmp_path: Path) -> None:
    root = _copy(tmp_path, 'version = "1.0"\n[verifier]\ntimeout_sec = 60\n')
    issues = _issues(root)
    message = issues["task.toml [environment] docker_image"]
    assert (
        "has only environment/Dockerfile" in message and "set [environment] docker_image" in message
    )
    (root / "environment" / "Dockerfile").unlink()
    assert "names no image" in _issues(root)["task.toml [environment] docker_image"]


def test_every_problem_is_named_in_task_toml_terms(tmp_path: Path) -> None:
    root = _copy(
        tmp_path,
        'version = "1.0"\n[environment]\ndocker_image = "bad image!"\n'
        '[metadata.sandman]\nbase_commit = "abc"\nrepo_path = "/a b"\ncolour = 1\n'
        '[verifier]\nuser = "Root;rm"\nenv = { KEY = "${HOST_SECRET}", SANDMAN_X = "1" }\n',
    )
    (root / "tests" / "test.sh").unlink()
    issues = _issues(root)
    assert set(issues) >= {
        "task.toml [environment] docker_image",
        "task.toml [metadata.sandman] base_commit",
        "task.toml [metadata.sandman] repo_path",
        "task.toml [metadata.sandman] colour",
        "task.toml [verifier] user",
        "task.toml [verifier.env] KEY",
        "task.toml [verifier.env] SANDMAN_X",
        "tests/test.sh",
    }, issues
    assert "templates" in issues["task.toml [verifier.env] KEY"]


def test_unsupported_harbor_features_are_refused(tmp_path: Path) -> None:
    toml = (EVEN / "task.toml").read_text()
    toml = toml.replace("cpus = 1", "cpus = 1\ngpus = 1")
    toml += '\n[verifier.environment]\ndocker_image = "verifier:v1"\n'
    issues = _issues(_copy(tmp_path, toml))
    assert "no GPU" in issues["task.toml [environment] gpus"]
    assert "not supported" in issues["task.toml [verifier.environment]"]


@pytest.mark.parametrize("repo_path", ["/tests", "/logs/verifier/x", "/solution"])
def test_the_repository_cannot_live_where_the_grader_stages(tmp_path: Path, repo_path: str) -> None:
    toml = (
        (EVEN / "task.toml")
        .read_text()
        .replace('repo_path = "/repo"', f'repo_path = "{repo_path}"')
    )
    assert "makes anew" in _issues(_copy(tmp_path, toml))["task.toml [metadata.sandman] repo_path"]


def test_missing_base_commit_is_explained(tmp_path: Path) -> None:
    root = _copy(tmp_path, '[environment]\ndocker_image = "localhost/x:v1"\n')
    assert "git diff" in _issues(root)["task.toml [metadata.sandman] base_commit"]


@pytest.mark.parametrize(
    ("files", "want"),
    [
        ({"reward.txt": b"1\n"}, (1.0, "reward.txt")),
        ({"reward.txt": b" 0.25 "}, (0.25, "reward.txt")),
        ({"reward.json": b'{"reward": 0.5, "style": 1.0}'}, (0.5, "reward.json")),
        ({"reward.json": b'{"score": 1}'}, (1.0, "reward.json")),  # one numeric value
        ({"reward.txt": b"0", "reward.json": b'{"reward": 1}'}, (0.0, "reward.txt")),
    ],
)
def test_reward_files(files: dict[str, bytes], want: tuple[float, str]) -> None:
    value, source, _metrics = parse_reward(files)
    assert (value, source) == want


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({}, "wrote no reward.txt or reward.json"),
        ({"reward.txt": b"yes"}, "not a number"),
        ({"reward.txt": b"nan"}, "no finite reward"),
        ({"reward.json": b"[1]"}, "not a JSON object"),
        ({"reward.json": b'{"a": 1, "b": 0}'}, "no finite reward"),  # which one?
        ({"reward.json": b'{"reward": true}'}, "no finite reward"),
    ],
)
def test_no_reward_is_explained(files: dict[str, bytes], why: str) -> None:
    value, reason, _ = parse_reward(files)
    assert value is None and why in reason


def test_cli_reads_a_harbor_dir_as_one_task(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "tests" / "fixture.json").write_text("{}")  # inside a task: not a task file
    (tmp_path / "plain.json").write_text("{}")
    assert _task_files((str(tmp_path),)) == [tmp_path / "plain.json", root]
    assert _task_files((str(root),)) == [root]
    assert _task_files((str(HARBOR),)) == [HARBOR / "median-even", HARBOR / "median-vacuous"]
