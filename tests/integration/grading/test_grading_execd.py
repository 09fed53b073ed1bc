"""Grading end to end against real execd processes and real git repositories.

Each "sandbox" is ``python3 -m execd`` serving a fresh copy of the SWE demo repository,
committed exactly as deploy/images/build.sh does (same author, dates and message), so
its commit hash IS the task's base_commit. Grading sandboxes are never used twice: every
acquire copies the template again and starts a new execd with the requested env.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.grading import GradeConfig, Grader, GradingClient, Verdict, extract_patch, load_task
from broker.grading.direct import DirectSandbox
from broker.grading.preflight import run_preflight, write_reports
from broker.grading.seam import SandboxRequest
from broker.grading.spec import Conditions
from broker.names import ENV_VISIBLE_CPUS
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
SWE = REPO / "deploy" / "images" / "swe-task"
SPECS = SWE / "specs"
BASE = "cd0583af25d6bab48aa2c08cb82ec1494d7cba34"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "sandman",
    "GIT_AUTHOR_EMAIL": "sandman@localhost",
    "GIT_COMMITTER_NAME": "sandman",
    "GIT_COMMITTER_EMAIL": "sandman@localhost",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
}
CONDITION_VARS = ("PYTHONHASHSEED", "TZ", "LANG", "LC_ALL")


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    out = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("swe-template") / "repo"
    shutil.copytree(SWE / "repo", root, ignore=shutil.ignore_patterns("__pycache__"))
    _git(root, "init", "-q", "-b", "main", ".")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "statlib: base commit")
    assert _git(root, "rev-parse", "HEAD") == BASE
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def execd(workdir: Path, env: dict[str, str]) -> Iterator[DirectSandbox]:
    token = secrets.token_hex(16)
    port = _free_port()
    child_env = {k: v for k, v in os.environ.items() if k not in CONDITION_VARS}
    child_env.update(env, SANDMAN_EXECD_TOKEN=token)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "execd",
            "--listen",
            f"127.0.0.1:{port}",
            "--workdir",
            str(workdir),
            "--log-level",
            "WARNING",
        ],
        cwd=REPO,
        env=child_env,
        start_new_session=True,
    )
    try:

        def healthy() -> bool:
            assert proc.poll() is None, "execd exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 20, 0.05, "execd to come up")
        with DirectSandbox(f"127.0.0.1:{port}", token, sandbox_id=f"execd-{port}") as sb:
            sb.process = proc  # type: ignore[attr-defined]
            yield sb
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class LocalGradingSandboxes:
    """An Acquire: a never-used execd + repo copy at one fixed path per grading."""

    def __init__(self, template: Path, repo_path: Path) -> None:
        self.template = template
        self.repo_path = repo_path
        self.requests: list[SandboxRequest] = []
        self.lock = threading.Lock()
        self.drop_env = False

    @contextlib.contextmanager
    def __call__(self, request: SandboxRequest) -> Iterator[DirectSandbox]:
        self.requests.append(request)
        with self.lock:
            shutil.rmtree(self.repo_path, ignore_errors=True)
            shutil.copytree(self.template, self.repo_path, symlinks=True)
            env = {} if self.drop_env else dict(request.env)
            if request.visible_cpus is not None and not self.drop_env:
                # What the broker adds to a pod's env (AcquireRequest.sandbox_env).
                env[ENV_VISIBLE_CPUS] = str(request.visible_cpus)
            with execd(self.repo_path, env) as sb:
                yield sb


@pytest.fixture
def sandboxes(template: Path, tmp_path: Path) -> LocalGradingSandboxes:
    return LocalGradingSandboxes(template, tmp_path / "grading" / "repo")


def local(spec_path: Path, sandboxes: LocalGradingSandboxes):  # type: ignore[no-untyped-def]
    return dataclasses.replace(load_task(spec_path), repo_path=str(sandboxes.repo_path))


FAST = GradeConfig(max_attempts=2, retry_backoff_s=0.05, egress_timeout_s=2.0)


def test_reference_resolves_with_probe_report(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.RESOLVED, result.reason + result.output_tail
    assert result.reward == 1.0
    assert result.fail_to_pass == {"tests.test_stats.MedianTests.test_median_even": "passed"}
    assert set(result.pass_to_pass.values()) == {"passed"}
    assert sandboxes.requests[0].role == "grading"
    assert result.probe is not None
    egress = next(c for c in result.probe["checks"] if c["field"] == "egress")
    assert egress["observed"] == "denied" and "no DNS answer" in egress["detail"]
    assert "egress: denied (no DNS answer)" in result.probe["lines"]
    assert len(result.attempts) == 1 and result.attempts[0].outcome == "graded"
    assert result.attempts[0].durations["probe_s"] > 0


def test_empty_patch_fails(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, b"")
    assert result.verdict is Verdict.UNRESOLVED
    assert result.reward == 0.0
    assert result.fail_to_pass["tests.test_stats.MedianTests.test_median_even"] == "failed"


def test_wrong_patch_fails(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, (SPECS / "wrong.patch").read_bytes())
    assert result.verdict is Verdict.UNRESOLVED
    assert result.pass_to_pass["tests.test_stats.MedianTests.test_median_odd"] == "failed"


def test_patch_that_does_not_apply_is_unresolved(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    bogus = (SPECS / "wrong.patch").read_bytes().replace(b"mid = len", b"mid = LEN")
    result = Grader(sandboxes, FAST).grade(task, bogus)
    assert result.verdict is Verdict.UNRESOLVED
    assert result.reason.startswith("patch does not apply")


def test_patch_editing_tests_is_not_rewarded(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, (SPECS / "tests-edit.patch").read_bytes())
    assert result.verdict is Verdict.UNRESOLVED
    assert set(result.dropped_files) == {"tests/test_stats.py", "tests/conftest.py"}
    assert result.fail_to_pass["tests.test_stats.MedianTests.test_median_even"] == "failed"


def test_swebench_fields_test_patch_and_conditions(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SPECS / "swebench-style.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.RESOLVED, result.reason
    assert result.fail_to_pass["test_median_even_floats (tests.test_stats.MedianTests)"] == "passed"
    assert sandboxes.requests[0].env == {
        "PYTHONHASHSEED": "0",
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    assert result.probe is not None
    statuses = {c["field"]: c["status"] for c in result.probe["checks"]}
    for name in ("timeout_s", "pythonhashseed", "egress", "tz", "locale"):
        assert statuses[name] == "ok", result.probe["checks"]
    # The same agent patch that only edits the tests fails under the hardened test patch.
    empty = Grader(sandboxes, FAST).grade(task, (SPECS / "tests-edit.patch").read_bytes())
    assert empty.verdict is Verdict.UNRESOLVED


def test_declared_egress_allowed_is_refused(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SPECS / "egress-allowed.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.INFRA_ERROR
    assert result.reward is None
    assert result.infra_kind == "probe_contradiction"
    assert [a.error_kind for a in result.attempts] == ["probe_contradiction"] * 2
    assert result.probe is not None and result.probe["contradictions"] == ["egress"]
    assert result.tests == {}  # nothing ran


def test_seed_the_pod_did_not_set_is_refused(sandboxes: LocalGradingSandboxes) -> None:
    sandboxes.drop_env = True  # a pod that ignores the requested environment
    task = local(SPECS / "swebench-style.json", sandboxes)
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.INFRA_ERROR
    assert result.probe is not None
    assert {"pythonhashseed", "tz", "locale"} <= set(result.probe["contradictions"])


def test_visible_cpus_are_delivered_to_the_tests(sandboxes: LocalGradingSandboxes) -> None:
    """visible_cpus is applied, not only checked: execd pins every command to it, so the
    probe (in the tests' shell) sees exactly that count; a sandbox that ignores it is
    refused."""
    task = local(SWE / "task.json", sandboxes)
    task = dataclasses.replace(task, conditions=Conditions(visible_cpus=1))
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.RESOLVED, result.reason
    assert sandboxes.requests[0].visible_cpus == 1
    assert result.probe is not None
    visible = next(c for c in result.probe["checks"] if c["field"] == "visible_cpus")
    assert (visible["status"], visible["observed"]) == ("ok", 1)
    if len(os.sched_getaffinity(0)) > 1:  # with one CPU, nothing could contradict it
        sandboxes.drop_env = True
        ignored = Grader(sandboxes, FAST).grade(task, task.reference_patch)
        assert ignored.verdict is Verdict.INFRA_ERROR
        assert ignored.probe is not None
        assert ignored.probe["contradictions"] == ["visible_cpus"]


def test_declared_memory_limit_contradicts_unlimited_process(
    sandboxes: LocalGradingSandboxes,
) -> None:
    task = local(SWE / "task.json", sandboxes)
    task = dataclasses.replace(
        task, conditions=dataclasses.replace(task.conditions, memory_b=1 << 30)
    )
    result = Grader(sandboxes, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.INFRA_ERROR
    assert result.probe is not None and "memory" in result.probe["contradictions"]


def test_lost_sandbox_is_retried_and_labelled(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    calls = {"n": 0}

    @contextlib.contextmanager
    def flaky(request: SandboxRequest) -> Iterator[DirectSandbox]:
        calls["n"] += 1
        with sandboxes(request) as sb:
            if calls["n"] == 1:  # the pod dies under the grader
                os.killpg(sb.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
                sb.process.wait()  # type: ignore[attr-defined]
            yield sb

    result = Grader(flaky, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.RESOLVED
    assert [a.outcome for a in result.attempts] == ["infra_error", "graded"]
    assert result.attempts[0].error_kind == "sandbox_lost"

    calls["n"] = -(10**6)  # every attempt loses its sandbox now

    @contextlib.contextmanager
    def dead(request: SandboxRequest) -> Iterator[DirectSandbox]:
        with sandboxes(request) as sb:
            os.killpg(sb.process.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            sb.process.wait()  # type: ignore[attr-defined]
            yield sb

    result = Grader(dead, FAST).grade(task, task.reference_patch)
    assert result.verdict is Verdict.INFRA_ERROR and result.reward is None
    assert result.infra_kind == "sandbox_lost"
    assert len(result.attempts) == FAST.max_attempts


def _agent_session(sb: DirectSandbox) -> None:
    """What a misbehaving agent does in its rollout sandbox."""
    fix = (SWE / "reference.patch").read_text()
    sb.write_file("/tmp/fix.patch", fix)
    script = r"""
set -e
git apply /tmp/fix.patch
printf 'new module\n' > statlib/extra.py
printf '\x00\x01\x02binary\xff' > statlib/blob.bin
rm README.md                                        # a deletion
chmod +x statlib/__init__.py                        # a mode change
ln -s stats.py statlib/link.py                      # a symlink
sed -i 's/2.5)/3)/' tests/test_stats.py           # weaken the test
printf 'import pytest\n' > tests/conftest.py        # outcome rewriting attempt
python3 -m unittest tests.test_stats >/dev/null 2>&1 || true   # leaves __pycache__
git -c user.name=a -c user.email=a@b commit -qam 'agent commit'   # move HEAD
git config core.fsmonitor 'touch /tmp/fsmonitor-ran; false'
git config filter.evil.clean 'touch /tmp/filter-ran; cat'
printf '* filter=evil\n' > .gitattributes
printf '#!/bin/sh\ntouch /tmp/hook-ran\n' > .git/hooks/post-index-change
chmod +x .git/hooks/post-index-change
git update-ref refs/replace/$(git rev-parse HEAD~1) HEAD   # replace the base commit
rm -f .git/index
"""
    out = sb.exec(script, timeout=60)
    assert out.exit_code == 0, out.stderr


def test_extraction_from_tampered_rollout_then_grade(
    template: Path, tmp_path: Path, sandboxes: LocalGradingSandboxes
) -> None:
    rollout_repo = tmp_path / "rollout" / "repo"
    shutil.copytree(template, rollout_repo, symlinks=True)
    task = local(SWE / "task.json", sandboxes)
    with execd(rollout_repo, {}) as rollout:
        _agent_session(rollout)
        marker_dir = rollout.exec("ls /tmp", timeout=10).stdout
        extracted = extract_patch(rollout, dataclasses.replace(task, repo_path=str(rollout_repo)))
        for marker in ("fsmonitor-ran", "filter-ran", "hook-ran"):
            assert not Path("/tmp", marker).exists(), marker
        assert "fsmonitor-ran" not in marker_dir
    assert extracted.base_tree == "461b85991f0a1df40e2c79786c0a7d85884f699b"
    assert set(extracted.files) == {
        "statlib/stats.py",
        "statlib/extra.py",
        "statlib/blob.bin",
        "statlib/link.py",
        "statlib/__init__.py",
        "README.md",
        ".gitattributes",
    }
    assert b"GIT binary patch" in extracted.patch
    # test paths travel to the broker and are dropped there by the rule, so they are seen
    assert extracted.dropped == ["tests/conftest.py", "tests/test_stats.py"]
    assert b"tests/" not in extracted.patch and b"__pycache__" not in extracted.patch
    result = GradingClient(acquire=sandboxes, config=FAST).grade(task, extracted)
    assert result.verdict is Verdict.RESOLVED, result.reason
    # The new files arrived byte-exact in the grading sandbox.
    assert (sandboxes.repo_path / "statlib" / "blob.bin").read_bytes() == b"\x00\x01\x02binary\xff"
    assert (sandboxes.repo_path / "statlib" / "extra.py").read_text() == "new module\n"
    assert not (sandboxes.repo_path / "README.md").exists()
    assert os.access(sandboxes.repo_path / "statlib" / "__init__.py", os.X_OK)
    assert os.readlink(sandboxes.repo_path / "statlib" / "link.py") == "stats.py"


def test_extraction_refuses_missing_base(template: Path, tmp_path: Path) -> None:
    from broker.grading import PatchExtractionError

    repo = tmp_path / "gone" / "repo"
    shutil.copytree(template, repo, symlinks=True)
    task = dataclasses.replace(load_task(SWE / "task.json"), repo_path=str(repo))
    with execd(repo, {}) as sb:
        sb.exec("rm -rf .git", timeout=10)
        with pytest.raises(PatchExtractionError) as info:
            extract_patch(sb, task)
    assert info.value.reason == "base_commit_missing"


def test_async_grade(sandboxes: LocalGradingSandboxes) -> None:
    task = local(SWE / "task.json", sandboxes)
    client = GradingClient(acquire=sandboxes, config=FAST)

    async def both() -> list[Verdict]:
        results = await asyncio.gather(
            client.agrade(task, task.reference_patch), client.agrade(task, b"")
        )
        return [r.verdict for r in results]

    assert asyncio.run(both()) == [Verdict.RESOLVED, Verdict.UNRESOLVED]


def test_preflight_reports_and_excludes(sandboxes: LocalGradingSandboxes, tmp_path: Path) -> None:
    tasks = [
        local(SWE / "task.json", sandboxes),
        local(SPECS / "vacuous.yaml", sandboxes),
        local(SPECS / "egress-allowed.json", sandboxes),
    ]
    grader = Grader(sandboxes, dataclasses.replace(FAST, max_attempts=1))
    entries = run_preflight(grader, tasks, parallel=2)
    status = {e.task_id: e.status for e in entries}
    assert status == {
        "sandman-demo/statlib-median-even": "ok",
        "sandman-demo/statlib-vacuous": "empty_passes",
        "sandman-demo__statlib-declares-egress-allowed": "infra_error",
    }
    paths = write_reports(
        entries, tmp_path / "report", meta={"job": "it"}, exclude_file=tmp_path / "excluded.txt"
    )
    assert paths["exclude"].read_text() == "sandman-demo/statlib-vacuous\n"
    doc = json.loads(paths["json"].read_text())
    assert doc["counts"] == {"ok": 1, "empty_passes": 1, "infra_error": 1}
    assert "statlib-vacuous" in paths["markdown"].read_text()
