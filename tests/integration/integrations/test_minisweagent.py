"""mini-swe-agent on Sandman: its real DefaultAgent and deterministic test model fix the
project's SWE task in a sandbox, then Sandman's patch extraction takes the fix out; and
``execute`` answers exactly as mini-swe-agent's own LocalEnvironment for the same actions.

The environment is built the way mini-swe-agent's YAML configs build one
(``get_environment`` with ``environment_class``). The sandbox runs the SWE task image
(local store), whose repository at /repo is at the task's base_commit.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from broker.errors import InfrastructureError, UnknownJob
from broker.grading import extract_patch, load_task
from broker.integrations.minisweagent import SandmanEnvironment
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
SWE = REPO / "deploy" / "images" / "swe-task"
TASK = load_task(SWE / "task.json")
PROBLEM = json.loads((SWE / "task.json").read_text())["problem_statement"]


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"mswea-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name)
    return name


def _environment(stack: Settings, job: str, **config: Any) -> SandmanEnvironment:
    env = get_environment(
        {
            "environment_class": "broker.integrations.minisweagent.SandmanEnvironment",
            "image": TASK.image,
            "job": job,
            "redis_url": stack.redis_url,
            **config,
        }
    )
    assert isinstance(env, SandmanEnvironment)
    return env


def _released(sessions: Any, sandbox_id: str) -> bool:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        return row is not None and row.state == State.DELETED


def _check_task_repo(env: SandmanEnvironment) -> None:
    """The image's own repository is the task's, at its base commit."""
    sandbox = env.sandbox
    assert sandbox is not None
    head = sandbox.run(["git", "rev-parse", "HEAD"], cwd=TASK.repo_path, timeout=60)
    assert head.stdout.strip() == TASK.base_commit, head.stderr


def _hunks(patch: bytes) -> list[bytes]:
    """The changed lines of a patch (headers and index lines differ in abbreviation)."""
    return [
        line
        for line in patch.splitlines()
        if line[:1] in (b"+", b"-") and not line.startswith((b"+++", b"---"))
    ]


def test_default_agent_fixes_the_swe_task_and_the_patch_is_extracted(
    stack: Settings, job: str, sessions: Any
) -> None:
    reference = TASK.reference_patch  # the bytes the task file names
    assert reference
    env = _environment(stack, job, workdir=TASK.repo_path, timeout=60)
    assert env.sandbox is not None
    sandbox_id = env.sandbox.id
    try:
        _check_task_repo(env)
        fix = f"git apply <<'PATCH'\n{reference.decode()}PATCH"
        outputs = [
            make_output("Look at the code.", [{"command": "cat statlib/stats.py"}]),
            make_output("Reproduce.", [{"command": "python3 -m unittest tests.test_stats"}]),
            make_output("Fix it.", [{"command": fix}]),
            make_output("Verify.", [{"command": "python3 -m unittest tests.test_stats 2>&1"}]),
            make_output(
                "Submit.",
                [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"}],
            ),
        ]
        agent = DefaultAgent(
            DeterministicModel(outputs=outputs),
            env,
            system_template="You fix bugs on {{system}} {{machine}}.",
            instance_template="{{task}}",
            step_limit=len(outputs),
            cost_limit=0,  # the test model bills 1.0 a call; 0 switches the limit off
        )
        result = agent.run(PROBLEM)
        assert result["exit_status"] == "Submitted"
        assert _hunks(result["submission"].encode()) == _hunks(reference)
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "def median" in observations[0]
        assert "<returncode>1</returncode>" in observations[1]  # the bug reproduces
        assert "FAILED" in observations[1]
        assert "<returncode>0</returncode>" in observations[3] and "OK" in observations[3]
        assert "Linux" in agent.messages[0]["content"]  # the sandbox's uname, templated

        extracted = extract_patch(env.sandbox, TASK)
        assert extracted.files == ["statlib/stats.py"] and not extracted.dropped
        assert _hunks(extracted.patch) == _hunks(reference)
    finally:
        env.cleanup()
    env.cleanup()  # idempotent
    assert env.sandbox is None
    wait_until(lambda: _released(sessions, sandbox_id), 60, 0.2, "the sandbox to be released")


ACTIONS = [
    "echo out; echo err >&2; echo again",
    "printf 'no newline'",
    "exit 3",
    "cd / && pwd && echo $PARITY_VAR",
    "printf '\\377\\376bad utf8\\n'",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo but it failed; exit 1",
]


def test_execute_answers_exactly_as_local_environment(
    stack: Settings, job: str, sessions: Any, tmp_path: Path
) -> None:
    local = LocalEnvironment(cwd=str(tmp_path), env={"PARITY_VAR": "v"}, timeout=30)
    env = _environment(stack, job, env={"PARITY_VAR": "v"})
    assert env.sandbox is not None
    sandbox_id = env.sandbox.id
    try:
        for command in ACTIONS:
            assert env.execute({"command": command}) == local.execute({"command": command})
        # A timeout: the output so far, returncode -1 and LocalEnvironment's exception text.
        slow = {"command": "echo started; sleep 30"}
        assert env.execute(slow, timeout=1) == local.execute(slow, timeout=1)
        # A missing cwd is the FileNotFoundError LocalEnvironment's Popen raises.
        missing = "/no/such/dir"
        assert env.execute({"command": "true"}, cwd=missing) == local.execute(
            {"command": "true"}, cwd=missing
        )
        # The submission sentinel: the same Submitted, carrying the rest of the output.
        submit = {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the answer"}
        with pytest.raises(Submitted) as ours:
            env.execute(submit)
        with pytest.raises(Submitted) as theirs:
            local.execute(submit)
        assert ours.value.messages == theirs.value.messages
        assert ours.value.messages[0]["extra"]["submission"] == "the answer\n"
        # The environment's own cwd config, then per-call cwd wins.
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        assert env.serialize()["info"]["config"]["environment_type"].endswith("SandmanEnvironment")
        assert {"system", "release", "version", "machine", "image", "job"} <= set(
            env.get_template_vars()
        )
        # The infrastructure failing is raised, never an observation: kill the sandbox's execd.
        with pytest.raises(InfrastructureError):
            env.execute({"command": "kill -9 $PPID; sleep 5"})
    finally:
        env.cleanup()
    wait_until(lambda: _released(sessions, sandbox_id), 60, 0.2, "the sandbox to be released")


def test_a_failed_acquire_raises_the_typed_error(stack: Settings) -> None:
    """The constructor raises Sandman's own error (the run fails before the agent starts)."""
    with pytest.raises(UnknownJob):
        _environment(stack, "no-such-job", acquire={"timeout": 5.0})
