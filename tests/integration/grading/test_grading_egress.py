"""A task's egress as the grading sandbox's own policy (issue #16 item 4), on the local
backend through a real worker.

The local backend has no egress guard (execd shares the host's network namespace), so
what it can show is the guard doing its job: a sandbox asked to deny egress is refused
(``GuardMissing``), never created open, and a task declaring ``denied`` is masked
(``infra_error``, reward None) there instead of graded in a sandbox that merely happens
to have no route out. ``allow`` is granted under an allowing job and refused under a
denying one (a request narrows its job's policy, never widens it).
"""

from __future__ import annotations

import dataclasses

import pytest

from broker.client.sync import SandboxClient
from broker.errors import EgressNotPermitted, GuardMissing
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


def test_deny_without_a_guard_is_refused_not_run_open(client: SandboxClient, sessions) -> None:  # type: ignore[no-untyped-def]
    with (
        pytest.raises(GuardMissing, match="egress"),
        client.acquire(job=JOB, egress="deny", **ARGS),
    ):
        pytest.fail("a deny-egress sandbox was handed out by a backend without a guard")


def test_allow_under_a_denying_job_is_refused(client: SandboxClient, sessions) -> None:  # type: ignore[no-untyped-def]
    with (
        pytest.raises(EgressNotPermitted, match="never widen"),
        client.acquire(job=DENYING_JOB, egress="allow", **ARGS),
    ):
        pytest.fail("a request widened its job's egress policy")


def test_a_task_declaring_denied_egress_is_masked_here(client: SandboxClient) -> None:
    task = load_task(SWE / "task.json")
    denied = dataclasses.replace(
        task, conditions=dataclasses.replace(task.conditions, egress="denied")
    )
    g = GradingClient(client, job=JOB, config=dataclasses.replace(CFG, max_attempts=1))
    result = g.grade(denied, task.reference_patch)
    assert result.verdict is Verdict.INFRA_ERROR and result.reward is None
    assert result.infra_kind == "guard_missing", result.reason
    allowed_job = g.grade(task, task.reference_patch)  # undeclared: the job's policy
    assert allowed_job.verdict is Verdict.RESOLVED, allowed_job.reason
