"""Harbor tasks graded and preflighted end to end on the local backend (issue #16 item 6):
real bubblewrap sandboxes in the SWE task image, served by a real worker.

``deploy/images/swe-task/harbor/median-even`` passes preflight (its ``solve.sh`` earns
1.0 in a separate verifier sandbox, the no-op 0.0); ``median-vacuous`` has a verifier
the no-op also passes and is flagged ``empty_passes``. A tampering agent that writes
``/logs/verifier/reward.txt`` (and its own ``/tests/test.sh``) during the rollout gets
nothing for it, and neither does a reward file already in the grading sandbox.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import pytest

from broker.client.sync import SandboxClient
from broker.grading import GradingClient, PreflightOptions, Verdict, load_task, run_preflight
from broker.grading.api import broker_acquire
from broker.grading.harbor import VerifierUserUnavailable
from broker.grading.seam import GradingSandbox, SandboxRequest
from tests.integration.grading.test_grading_local_backend import CFG, JOB, SWE, _env, client
from tests.support.images import REPO

pytestmark = pytest.mark.integration
__all__ = ["client"]  # the module fixture, shared with the local-backend grading tests

HARBOR = SWE / "harbor"
EVEN, VACUOUS = HARBOR / "median-even", HARBOR / "median-vacuous"
WRONG = (SWE / "specs" / "wrong.patch").read_bytes()


def _rollout(client: SandboxClient, image: str) -> AbstractContextManager[GradingSandbox]:
    return client.acquire(  # type: ignore[return-value]
        image=image, job=JOB, cpu=0.5, memory="512Mi", workdir="/repo", timeout=120
    )


def test_harbor_tasks_preflight_end_to_end(client: SandboxClient) -> None:
    tasks = [load_task(EVEN), load_task(VACUOUS)]
    grader = GradingClient(client, job=JOB, config=CFG).grader
    entries = run_preflight(grader, tasks, parallel=2, options=PreflightOptions())
    even, vacuous = entries
    assert even.status == "ok", (even.reference, even.empty, even.errors)
    assert even.reference["reward"] == 1.0 and even.empty["reward"] == 0.0
    assert vacuous.status == "empty_passes", (vacuous.reference, vacuous.empty)
    assert vacuous.excluded
    assert vacuous.empty["reward"] == 1.0 and vacuous.empty["reason"] == "reward.json: reward 1"


def test_harbor_grading_of_rollouts(client: SandboxClient) -> None:
    task = load_task(EVEN)
    g = GradingClient(client, job=JOB, config=CFG)
    with _rollout(client, task.image) as rollout:
        solve = (EVEN / "solution" / "solve.sh").read_bytes()
        rollout.write_file("/tmp/solve.sh", solve)
        assert rollout.exec("bash /tmp/solve.sh", timeout=60).exit_code == 0
        result = g.grade_rollout(rollout, task)  # type: ignore[arg-type]
    assert result.verdict is Verdict.RESOLVED and result.reward == 1.0, result.output_tail
    assert result.verifier == {"reward_file": "reward.txt", "metrics": {"reward": 1.0}}
    assert result.patch_files == ["statlib/stats.py"]
    # the verifier's env reached the tests: without it the fix fails (KeyError)
    assert "test_median_even" in result.output_tail and "OK" in result.output_tail

    wrong = g.grade(task, WRONG)
    assert wrong.verdict is Verdict.UNRESOLVED and wrong.reward == 0.0, wrong.output_tail


def test_a_tampering_agent_earns_nothing(client: SandboxClient) -> None:
    """During its rollout the agent writes reward 1, replaces /tests/test.sh and adds a
    test file to the repository: the verifier sandbox is fresh, /tests and
    /logs/verifier are made anew, the test file is dropped."""
    task = load_task(EVEN)
    g = GradingClient(client, job=JOB, config=CFG)
    with _rollout(client, task.image) as rollout:
        out = rollout.exec(
            "mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
            "printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && "
            "mkdir -p /repo/tests && echo 'import sys' > /repo/tests/test_median.py && "
            "echo '# agent' >> /repo/statlib/stats.py",
            timeout=60,
        )
        assert out.exit_code == 0, out.stderr
        result = g.grade_rollout(rollout, task)  # type: ignore[arg-type]
    assert result.verdict is Verdict.UNRESOLVED and result.reward == 0.0, result.output_tail
    assert result.dropped_files == ["tests/test_median.py"]
    assert result.patch_files == ["statlib/stats.py"]
    assert "FAIL: test_median_even" in result.output_tail


SUCCESS_ONLY = b"""#!/bin/bash
set -e
cd /repo
PYTHONPATH=/repo python3 -m unittest discover -v -s /tests -t /tests -p 'test_*.py'
echo 1 > /logs/verifier/reward.txt
"""
PLANTS = {
    "file": "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
    "symlinked dir": "mkdir -p /logs /tmp/elsewhere && echo 1 > /tmp/elsewhere/reward.txt"
    " && ln -s /tmp/elsewhere /logs/verifier",
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_reward_file_already_in_the_grading_sandbox_does_not_count(
    client: SandboxClient, plant: str
) -> None:
    """A reward file left in the grading sandbox before the verifier starts (in the dir,
    or behind a symlinked dir), with a verifier that writes a reward only on success
    (``set -e``, common in Harbor tasks): the grader makes /logs/verifier anew, so the
    no-op earns 0 ("no reward file"), not the planted 1."""
    acquire = broker_acquire(client, JOB)
    task = load_task(EVEN)
    assert task.harbor is not None
    tests = dict((rel, (data, mode)) for rel, data, mode in task.harbor.tests)
    tests["test.sh"] = (SUCCESS_ONLY, 0o755)
    staged = tuple((rel, data, mode) for rel, (data, mode) in sorted(tests.items()))
    task = replace(task, harbor=replace(task.harbor, tests=staged))

    @contextlib.contextmanager
    def planted(request: SandboxRequest) -> Iterator[GradingSandbox]:
        with acquire(request) as sandbox:
            assert sandbox.exec(PLANTS[plant], timeout=60).exit_code == 0
            yield sandbox

    result = GradingClient(acquire=planted, config=CFG).grade(task, b"")
    assert result.verdict is Verdict.UNRESOLVED and result.reward == 0.0, result.output_tail
    assert result.reason == "the verifier wrote no reward.txt or reward.json in /logs/verifier"
    fixed = GradingClient(acquire=planted, config=CFG).grade(
        task, (SWE / "reference.patch").read_bytes()
    )
    assert fixed.reward == 1.0, fixed.output_tail  # the verifier does write on success


def test_a_verifier_user_the_sandbox_cannot_switch_to_is_infra_error(
    client: SandboxClient,
) -> None:
    """The local backend's sandboxes cannot change uid: a task whose verifier runs as
    ``nobody`` is masked (reward None), never graded as root instead."""
    task = load_task(EVEN)
    assert task.harbor is not None
    as_nobody = replace(task, harbor=replace(task.harbor, verifier_user="nobody"))
    result = GradingClient(client, job=JOB, config=replace(CFG, max_attempts=1)).grade(
        as_nobody, b""
    )
    assert result.verdict is Verdict.INFRA_ERROR and result.reward is None
    assert result.infra_kind == VerifierUserUnavailable.code, result.reason


def test_cli_validate_grade_and_preflight_harbor_dirs(
    stack: object, client: SandboxClient, tmp_path: Path
) -> None:
    sandman = str(Path(sys.executable).parent / "sandman")
    env = _env(stack)  # type: ignore[arg-type]
    dockerfile_only = tmp_path / "built-here"
    (dockerfile_only / "environment").mkdir(parents=True)
    (dockerfile_only / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    (dockerfile_only / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n')

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sandman, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
            check=False,
        )  # fmt: skip

    validate = run("task", "validate", str(HARBOR), str(dockerfile_only))
    assert validate.returncode == 1, validate.stdout + validate.stderr
    assert f"{EVEN}: ok" in validate.stdout and f"{VACUOUS}: ok" in validate.stdout
    assert "task.toml [environment] docker_image: is required" in validate.stdout
    assert "has only environment/Dockerfile" in validate.stdout
    refused = run("grade", str(dockerfile_only), "--job", JOB)
    assert refused.returncode == 1 and "[environment] docker_image" in refused.stderr

    grade = run("grade", str(EVEN), str(SWE / "reference.patch"), "--job", JOB)
    assert grade.returncode == 0, grade.stdout + grade.stderr
    assert json.loads(grade.stdout)["reward"] == 1.0
    out = tmp_path / "report"
    preflight = run(
        "preflight", str(HARBOR), "--job", JOB, "-j", "2", "--out", str(out),
        "--cpu", "0.5", "--memory", "512Mi",
    )  # fmt: skip
    assert preflight.returncode == 1, preflight.stdout + preflight.stderr  # one is excluded
    doc = json.loads((out / "preflight.json").read_text())
    assert doc["counts"] == {"ok": 1, "empty_passes": 1}, doc
    assert (out / "excluded.txt").read_text() == "sandman-demo/harbor-median-vacuous\n"
    # no condition carries the passing task's verdict: no false flag, exit 0
    sensitive = run(
        "preflight", str(EVEN), "--sensitivity", "--job", JOB, "--out", str(tmp_path / "s"),
        "--cpu", "0.5", "--memory", "512Mi",
    )  # fmt: skip
    assert sensitive.returncode == 0, sensitive.stdout + sensitive.stderr
    (entry,) = json.loads((tmp_path / "s" / "preflight.json").read_text())["tasks"]
    assert entry["load_bearing"] == [] and entry["undeclared_dependency"] == []
    assert {r["status"] for r in entry["sensitivity"]} <= {"not_tested", "same"}
    assert [r["key"] for r in entry["sensitivity"] if r["status"] == "not_tested"] in (
        [],
        ["egress"],
    )
