"""mini-swe-agent on the local cluster, end to end: its real DefaultAgent and deterministic
test model fix the SWE task in a pod of ``localhost/sandman-swe-task:v1`` (repository at
/repo, at the task's base commit), Sandman extracts the patch from that rollout pod, and
GradingClient grades it in a fresh grading pod: rollout -> patch -> ``resolved``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from broker.grading import Verdict, load_task
from broker.integrations.minisweagent import SandmanEnvironment
from tests.cluster.test_grading_cluster import JOB, grader, stack  # noqa: F401 (the fixture)

pytestmark = pytest.mark.cluster
SWE = Path(__file__).resolve().parents[2] / "deploy" / "images" / "swe-task"


def test_minisweagent_rollout_patch_is_graded_resolved(stack: dict[str, Any]) -> None:  # noqa: F811
    task = load_task(SWE / "task.json")
    problem = json.loads((SWE / "task.json").read_text())["problem_statement"]
    reference = task.reference_patch
    assert reference
    env = get_environment(
        {
            "environment_class": "broker.integrations.minisweagent.SandmanEnvironment",
            "image": task.image,
            "job": JOB,
            "workdir": task.repo_path,
            "cpu": 0.5,
            "memory": "512Mi",
            "timeout": 120,
            "redis_url": stack["env"]["SANDMAN_REDIS_URL"],
            "acquire": {"timeout": 300.0},
        }
    )
    assert isinstance(env, SandmanEnvironment) and env.sandbox is not None
    outputs = [
        make_output("Reproduce.", [{"command": "python3 -m unittest tests.test_stats 2>&1"}]),
        make_output("Fix.", [{"command": f"git apply <<'PATCH'\n{reference.decode()}PATCH"}]),
        make_output("Verify.", [{"command": "python3 -m unittest tests.test_stats 2>&1"}]),
        make_output("Submit.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]),
    ]
    try:
        agent = DefaultAgent(
            DeterministicModel(outputs=outputs),
            env,
            system_template="You fix bugs on {{system}}.",
            instance_template="{{task}}",
            step_limit=len(outputs),
            cost_limit=0,
        )
        assert agent.run(problem)["exit_status"] == "Submitted"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "<returncode>1</returncode>" in observations[0]  # the bug, in the pod
        assert "<returncode>0</returncode>" in observations[2]
        g = grader(stack)
        extracted = g.extract(env.sandbox, task)
        assert extracted.files == ["statlib/stats.py"]
        result = g.grade(task, extracted)
        assert env.sandbox.id not in {a.sandbox_id for a in result.attempts}
    finally:
        env.cleanup()
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
