"""Grading on embedded defaults (issue #15 item 5): the local backend runs the SWE task
image (repository at /repo, at the task's base commit), so ``sandman grade`` and
``sandman preflight`` work there as they do on the cluster (tests/cluster/
test_grading_cluster.py). Before images, every grading sandbox was the host root and was
rejected ("not a git repository").

A real Celery worker with the local backend (the integration ``stack``) serves acquires.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client.sync import SandboxClient
from broker.grading import GradeConfig, GradingClient, Verdict, load_task
from broker.ledger import store
from broker.settings import Settings
from tests.support.images import REPO, SWE_IMAGE

pytestmark = pytest.mark.integration

SWE = REPO / "deploy" / "images" / "swe-task"
SPECS = SWE / "specs"
JOB = "grading-local"
CFG = GradeConfig(
    max_attempts=2, retry_backoff_s=0.5, memory="512Mi", cpu=0.5, acquire_timeout_s=120
)


@pytest.fixture(scope="module")
def client(stack: Settings, db_engine) -> Iterator[SandboxClient]:  # type: ignore[no-untyped-def]
    from broker.ledger.db import make_session_factory

    with make_session_factory(db_engine).begin() as session:
        store.ensure_job(session, JOB, readiness_budget_s=120.0)
    sandboxes = SandboxClient(stack.redis_url, owner="grading-local-tests")
    yield sandboxes
    sandboxes.close()


def _env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("state_dir", "database_url", "redis_url", "secret_key", "installation_id"):
        env[f"SANDMAN_{key.upper()}"] = str(getattr(settings, key))
    return env


def test_reference_empty_and_extracted_patches_on_the_local_backend(
    client: SandboxClient,
) -> None:
    task = load_task(SWE / "task.json")
    assert task.image == SWE_IMAGE
    g = GradingClient(client, job=JOB, config=CFG)
    ref = g.grade(task, task.reference_patch)
    assert ref.verdict is Verdict.RESOLVED, (ref.reason, ref.attempts, ref.output_tail)
    assert g.grade(task, b"").verdict is Verdict.UNRESOLVED
    with client.acquire(
        image=task.image, job=JOB, cpu=0.5, memory="512Mi", workdir="/workspace", timeout=120
    ) as rollout:
        rollout.write_file("/tmp/fix.patch", task.reference_patch or b"")
        out = rollout.exec("cd /repo && git apply /tmp/fix.patch && echo x > NEW.txt", timeout=60)
        assert out.exit_code == 0, out.stderr
        extracted = g.extract(rollout, task)
        result = g.grade(task, extracted)
        assert rollout.id not in {a.sandbox_id for a in result.attempts}
    assert set(extracted.files) == {"statlib/stats.py", "NEW.txt"}
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)


def test_grade_and_preflight_cli(stack: Settings, client: SandboxClient, tmp_path: Path) -> None:
    sandman = str(Path(sys.executable).parent / "sandman")
    grade = subprocess.run(
        [sandman, "grade", str(SWE / "task.json"), str(SWE / "reference.patch"), "--job", JOB],
        cwd=REPO, env=_env(stack), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert grade.returncode == 0, grade.stdout + grade.stderr
    assert json.loads(grade.stdout)["verdict"] == "resolved"
    out = tmp_path / "report"
    preflight = subprocess.run(
        [sandman, "preflight", str(SWE / "task.json"), str(SPECS / "vacuous.yaml"),
         "--job", JOB, "-j", "2", "--out", str(out), "--cpu", "0.5", "--memory", "512Mi"],
        cwd=REPO, env=_env(stack), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert preflight.returncode == 1, preflight.stdout + preflight.stderr  # one is excluded
    doc = json.loads((out / "preflight.json").read_text())
    assert doc["counts"] == {"ok": 1, "empty_passes": 1}, doc
    assert (out / "excluded.txt").read_text() == "sandman-demo/statlib-vacuous\n"
