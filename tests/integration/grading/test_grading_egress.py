"""A task's egress as the grading sandbox's own policy (issue #16 item 4), on the local
backend through a real worker.

Each local sandbox has its own network namespace (``broker.backends.localnet``): a
sandbox asked to deny egress gets its guard and loopback only, and a task declaring
``denied`` is graded in such a sandbox. ``allow`` is granted under an allowing job and
refused under a denying one (a request narrows its job's policy, never widens it).
"""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import select

from broker.client.sync import SandboxClient
from broker.errors import EgressNotPermitted
from broker.grading import GradingClient, Verdict, load_task
from broker.ledger import store
from broker.ledger.db import make_session_factory
from broker.ledger.models import Sandbox
from broker.settings import Settings
from tests.integration.grading.test_grading_local_backend import CFG, JOB, SWE, client
from tests.support.images import SWE_IMAGE

pytestmark = pytest.mark.integration
__all__ = ["client"]  # the module fixture, shared with the local-backend grading tests

DENYING_JOB = "grading-local-denied"
ARGS = {"image": SWE_IMAGE, "cpu": 0.5, "memory": "512Mi", "workdir": "/repo", "timeout": 120}


@pytest.fixture(scope="module")
def sessions(stack: Settings, db_engine):  # type: ignore[no-untyped-def]
    factory = make_session_factory(db_engine)
    with factory.begin() as session:
        store.ensure_job(session, DENYING_JOB, egress="deny", readiness_budget_s=120.0)
    return factory


def _denied(sessions, sandbox_id: str) -> bool:  # type: ignore[no-untyped-def]
    with sessions.begin() as session:
        row = session.get(Sandbox, sandbox_id)
        assert row is not None
        return bool(row.egress_denied)


def test_allow_is_granted_under_an_allowing_job(client: SandboxClient, sessions) -> None:  # type: ignore[no-untyped-def]
    with client.acquire(job=JOB, egress="allow", **ARGS) as sandbox:
        assert sandbox.exec("echo up", timeout=60).stdout.strip() == "up"
        assert _denied(sessions, sandbox.id) is False


def test_deny_is_granted_with_its_guard_and_enforced(client: SandboxClient, sessions) -> None:  # type: ignore[no-untyped-def]
    """The local backend's guard (a per-job file, then a sandbox netns with loopback
    only): the sandbox is recorded denied and cannot open a route out."""
    probe = (
        'python3 -c "import socket\n'
        "try:\n socket.create_connection(('10.0.2.2', 9), timeout=3); print('open')\n"
        "except OSError as e:\n print('refused', e.errno)\""
    )
    with client.acquire(job=JOB, egress="deny", **ARGS) as sandbox:
        assert _denied(sessions, sandbox.id) is True
        out = sandbox.exec(probe, timeout=60).stdout.strip()
        assert out.startswith("refused"), out


def test_allow_under_a_denying_job_is_refused(client: SandboxClient, sessions) -> None:  # type: ignore[no-untyped-def]
    with (
        pytest.raises(EgressNotPermitted, match="never widen"),
        client.acquire(job=DENYING_JOB, egress="allow", **ARGS),
    ):
        pytest.fail("a request widened its job's egress policy")


def test_a_task_declaring_denied_egress_is_graded_in_a_denied_sandbox(
    client: SandboxClient, sessions
) -> None:  # type: ignore[no-untyped-def]
    task = load_task(SWE / "task.json")
    denied = dataclasses.replace(
        task, conditions=dataclasses.replace(task.conditions, egress="denied")
    )
    before = _denied_rows(sessions)
    g = GradingClient(client, job=JOB, config=dataclasses.replace(CFG, max_attempts=1))
    result = g.grade(denied, task.reference_patch)
    assert result.verdict is Verdict.RESOLVED and result.reward == 1.0, result.reason
    assert _denied_rows(sessions) == before + 1, "graded in a sandbox denied egress"
    allowed_job = g.grade(task, task.reference_patch)  # undeclared: the job's policy
    assert allowed_job.verdict is Verdict.RESOLVED, allowed_job.reason
    assert _denied_rows(sessions) == before + 1


def _denied_rows(sessions) -> int:  # type: ignore[no-untyped-def]
    with sessions.begin() as session:
        return len(
            session.scalars(
                select(Sandbox.id).where(Sandbox.job == JOB, Sandbox.egress_denied.is_(True))
            ).all()
        )
