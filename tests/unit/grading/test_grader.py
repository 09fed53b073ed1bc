"""Probe decisions, verdicts, retries and preflight classification, with fakes at the seam.

The only fake is the sandbox behind ``broker.grading.seam`` (the Acquire callable): it
answers the probe with canned observations, the apply step with an exit code and the
test command with canned runner output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.client.sync import ExecResult
from broker.errors import AcquireTimeout, SandboxLost
from broker.grading.grade import GradeConfig, Grader
from broker.grading.preflight import classify
from broker.grading.probe import decide
from broker.grading.results import GradeResult, Verdict
from broker.grading.seam import SandboxRequest
from broker.grading.spec import Conditions, load_task

pytestmark = pytest.mark.unit

SWE = Path(__file__).resolve().parents[3] / "deploy" / "images" / "swe-task"
GOOD_RUN = """test_median_even (tests.test_stats.MedianTests.test_median_even) ... ok
test_mean (tests.test_stats.MeanTests.test_mean) ... ok
test_mean_empty (tests.test_stats.MeanTests.test_mean_empty) ... ok
test_median_odd (tests.test_stats.MedianTests.test_median_odd) ... ok
test_median_empty (tests.test_stats.MedianTests.test_median_empty) ... ok
"""
BAD_RUN = GOOD_RUN.replace("test_median_even) ... ok", "test_median_even) ... FAIL")


def observed(**over: Any) -> dict[str, Any]:
    obs: dict[str, Any] = {
        "env": {"PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
        "memory": {"readable": True, "limit_b": 2 << 30, "cgroup": "v2"},
        "cpu": {"quota_readable": True, "quota_cpus": 1.0, "visible": 8},
        "egress": {"state": "denied", "reason": "no DNS answer", "host": "example.com"},
        "tz": {"env": "UTC", "tzname": ["UTC", "UTC"], "utcoffset_s": 0, "expected_offset_s": 0},
        "locale": {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "available": True},
    }
    obs.update(over)
    return obs


DECLARED = Conditions(
    timeout_s=600,
    pythonhashseed="0",
    memory_b=2 << 30,
    cpus=1.0,
    visible_cpus=8,
    egress="denied",
    tz="UTC",
    locale="C.UTF-8",
)


def statuses(checks: list[Any]) -> dict[str, str]:
    return {c.field: c.status for c in checks}


def test_probe_all_ok_and_undeclared_fields() -> None:
    assert set(statuses(decide(DECLARED, observed(), grader_timeout_s=600)).values()) == {"ok"}
    undeclared = statuses(decide(Conditions(), observed(), grader_timeout_s=600))
    assert set(undeclared.values()) == {"not_declared"}


@pytest.mark.parametrize(
    ("field", "obs", "timeout"),
    [
        ("timeout_s", {}, None),  # the grader sends no timeout
        ("timeout_s", {}, 1800),
        ("pythonhashseed", {"env": {"PYTHONHASHSEED": None}}, 600),
        ("memory", {"memory": {"readable": True, "limit_b": 16 << 30}}, 600),
        ("memory", {"memory": {"readable": True, "limit_b": None}}, 600),
        ("cpus", {"cpu": {"quota_readable": True, "quota_cpus": None, "visible": 8}}, 600),
        ("egress", {"egress": {"state": "allowed", "reason": "verified TLS"}}, 600),
        ("egress", {"egress": {"state": "intercepted", "reason": "bad cert"}}, 600),
        ("tz", {"tz": {"env": "UTC", "utcoffset_s": 32400, "expected_offset_s": 0}}, 600),
        ("locale", {"locale": {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "available": False}}, 600),
    ],
)
def test_probe_contradictions(field: str, obs: dict[str, Any], timeout: float | None) -> None:
    checks = statuses(decide(DECLARED, observed(**obs), grader_timeout_s=timeout))
    assert checks[field] == "contradiction"
    assert [f for f, s in checks.items() if s == "contradiction"] == [field]


AT_LEAST = Conditions(min_cpus=2.0, min_memory_b=2 << 30)


@pytest.mark.parametrize(
    ("cpu", "memory", "want"),
    [
        # min_cpus: the quota capped by the visible CPUs; min_memory: the cgroup limit.
        ({"quota_readable": True, "quota_cpus": 4.0, "visible": 8}, 4 << 30, ("ok", "ok")),
        ({"quota_readable": True, "quota_cpus": 2.0, "visible": 2}, 2 << 30, ("ok", "ok")),
        ({"quota_readable": True, "quota_cpus": None, "visible": 2}, None, ("ok", "ok")),
        ({"quota_readable": False, "visible": 3}, None, ("ok", "ok")),
        (
            {"quota_readable": True, "quota_cpus": 1.5, "visible": 8},
            1 << 30,
            ("contradiction", "contradiction"),
        ),
        (
            {"quota_readable": True, "quota_cpus": 4.0, "visible": 1},
            (2 << 30) - (1 << 20),  # within 1%
            ("contradiction", "ok"),
        ),
        ({"quota_readable": True, "quota_cpus": None, "visible": 1}, None, ("contradiction", "ok")),
        ({"quota_readable": False, "visible": None}, None, ("unreadable", "ok")),
    ],
)
def test_probe_at_least_conditions(
    cpu: dict[str, Any], memory: int | None, want: tuple[str, str]
) -> None:
    """min_cpus/min_memory mean "at least": more is fine, unlimited memory is fine."""
    obs = observed(cpu=cpu, memory={"readable": True, "limit_b": memory, "cgroup": "v2"})
    checks = statuses(decide(AT_LEAST, obs, grader_timeout_s=600))
    assert (checks["min_cpus"], checks["min_memory"]) == want
    assert checks["memory"] == "not_declared"  # the exact fields are not checked
    assert checks["cpus"] in ("not_declared", "unreadable")
    unreadable = observed(memory={"readable": False, "error": "no cgroup"})
    assert statuses(decide(AT_LEAST, unreadable, grader_timeout_s=600))["min_memory"] == (
        "unreadable"
    )
    # Undeclared, the at-least fields are not checked (no line in the report).
    assert "min_cpus" not in statuses(decide(Conditions(), obs, grader_timeout_s=600))


def test_at_least_conditions_size_the_request() -> None:
    grader = Grader(FakeAcquire({}), GradeConfig(cpu=1.0, memory="2Gi"))
    more = dataclasses.replace(task(), conditions=Conditions(min_cpus=3.0, min_memory_b=8 << 30))
    assert (grader.request_for(more).cpu, grader.request_for(more).memory_b) == (3.0, 8 << 30)
    less = dataclasses.replace(task(), conditions=Conditions(min_cpus=0.5, min_memory_b=1 << 30))
    assert (grader.request_for(less).cpu, grader.request_for(less).memory_b) == (1.0, 2 << 30)


@pytest.mark.parametrize(
    ("declared", "asked"), [("denied", "deny"), ("allowed", "allow"), (None, None)]
)
def test_a_tasks_egress_is_the_grading_sandboxs_own(
    declared: str | None, asked: str | None
) -> None:
    """Delivered per sandbox (the broker guards a denied one), then checked by the probe."""
    grader = Grader(FakeAcquire({}), GradeConfig())
    spec = dataclasses.replace(task(), conditions=Conditions(egress=declared))
    assert grader.request_for(spec).egress == asked


def test_probe_unreadable_is_reported_not_passed() -> None:
    obs = observed(memory={"readable": False, "error": "no cgroup"}, cpu={"visible": None})
    checks = statuses(decide(DECLARED, obs, grader_timeout_s=600))
    assert checks["memory"] == checks["cpus"] == checks["visible_cpus"] == "unreadable"
    tz_missing = observed(tz={"env": "Asia/Tokyo", "utcoffset_s": 0, "zone_file": False})
    declared = dataclasses.replace(DECLARED, tz="Asia/Tokyo")
    assert statuses(decide(declared, tz_missing, grader_timeout_s=600))["tz"] == "contradiction"


class FakeSandbox:
    def __init__(self, script: dict[str, Any]) -> None:
        self.id = f"fake-{id(self)}"
        self.script = script
        self.files: dict[str, bytes] = {}
        self.commands: list[str] = []

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        self.commands.append(command)
        if "mktemp -d" in command:
            return ExecResult(0, f"SANDMAN-WORK /tmp/sandman-grade.{id(self)}\n", "")
        if command.startswith("rm -rf"):
            self.script.setdefault("removed", []).append(command)
            return ExecResult(0, "", "")
        if "apply --numstat" in command:
            self.files[command.rsplit("> ", 1)[1].strip("'")] = self.script.get("numstat", b"")
            return ExecResult(0, "", "")
        if "SANDMAN-OOM-KILLS" in command and "SANDMAN-APPLIED" not in command:
            return ExecResult(0, f"SANDMAN-OOM-KILLS {self.script.get('oom_after', 0)}\n", "")
        if "sandman-probe" in command:
            if self.script.get("lose_on_probe"):
                raise SandboxLost("pod deleted")
            probe = json.dumps(self.script.get("observed", observed(env={})))
            return ExecResult(0, "SANDMAN-PROBE " + probe + "\n", "")
        if "SANDMAN-APPLIED" in command:
            self.script.setdefault("applies", []).append(command)
            code = self.script.get("apply_exit", 0)
            out = "SANDMAN-OOM-KILLS 0\nSANDMAN-APPLIED\n" if code == 0 else ""
            return ExecResult(code, out, "apply said no")
        self.script["test_timeout"] = timeout
        run = self.script.get("run", GOOD_RUN)
        # unittest's exit status: 1 when a test failed (or no test ran), else 0.
        failed = " ... FAIL" in run or " ... ok" not in run
        return ExecResult(
            self.script.get("exit", 1 if failed else 0),
            "",
            run,
            self.script.get("timed_out", False),
        )

    def read_file(self, path: str) -> bytes:
        return self.files[path]

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        self.files[path] = content.encode() if isinstance(content, str) else content
        return len(self.files[path])


class FakeAcquire:
    def __init__(self, *scripts: dict[str, Any]) -> None:
        self.scripts = list(scripts)
        self.requests: list[SandboxRequest] = []
        self.released: list[str] = []

    @contextlib.contextmanager
    def __call__(self, request: SandboxRequest) -> Iterator[FakeSandbox]:
        self.requests.append(request)
        script = self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]
        if script.get("acquire_timeout"):
            raise AcquireTimeout("no sandbox in time")
        sandbox = FakeSandbox(script)
        try:
            yield sandbox
        finally:
            self.released.append(sandbox.id)


CFG = GradeConfig(max_attempts=3, retry_backoff_s=0)


def task() -> Any:
    return load_task(SWE / "task.json")


def test_resolved_unresolved_and_request_shape() -> None:
    fake = FakeAcquire({"run": GOOD_RUN})
    result = Grader(fake, CFG, sleep=lambda s: None).grade(task(), task().reference_patch)
    assert result.verdict is Verdict.RESOLVED and result.reward == 1.0
    request = fake.requests[0]
    assert request.role == "grading" and request.workdir == "/repo"
    assert request.base_commit == task().base_commit
    assert len(fake.released) == 1
    bad = Grader(FakeAcquire({"run": BAD_RUN}), CFG).grade(task(), b"")
    assert bad.verdict is Verdict.UNRESOLVED and bad.reward == 0.0
    assert "FAIL_TO_PASS not passing" in bad.reason


def test_non_zero_exit_without_a_failing_test_is_unresolved() -> None:
    """The log says every test passed but the test command failed: the log does not
    describe the run (fake status lines), so it is not rewarded (as SWE-bench does)."""
    lying = Grader(FakeAcquire({"run": GOOD_RUN, "exit": 1}), CFG).grade(task(), b"")
    assert lying.verdict is Verdict.UNRESOLVED and lying.reward == 0.0
    assert "exited 1 but its output reports no failing test" in lying.reason


def test_timeout_no_output_and_non_applying_patch_are_unresolved() -> None:
    timed = Grader(FakeAcquire({"run": GOOD_RUN, "timed_out": True}), CFG).grade(task(), b"")
    assert timed.verdict is Verdict.UNRESOLVED and "timed out" in timed.reason
    silent = Grader(FakeAcquire({"run": "Traceback: boom"}), CFG).grade(task(), b"")
    assert silent.verdict is Verdict.UNRESOLVED and "no test results" in silent.reason
    broken = Grader(FakeAcquire({"apply_exit": 20}), CFG).grade(task(), b"")
    assert broken.verdict is Verdict.UNRESOLVED and "does not apply" in broken.reason


def test_infrastructure_failures_are_retried_then_labelled() -> None:
    fake = FakeAcquire({"acquire_timeout": True}, {"lose_on_probe": True}, {"run": GOOD_RUN})
    slept: list[float] = []
    result = Grader(fake, GradeConfig(retry_backoff_s=0.5), sleep=slept.append).grade(
        task(), task().reference_patch
    )
    assert result.verdict is Verdict.RESOLVED
    assert [a.error_kind for a in result.attempts] == ["acquire_timeout", "sandbox_lost", None]
    assert slept == [0.5, 1.0]
    always = FakeAcquire({"lose_on_probe": True})
    failed = Grader(always, CFG).grade(task(), task().reference_patch)
    assert failed.verdict is Verdict.INFRA_ERROR and failed.reward is None
    assert failed.infra_kind == "sandbox_lost" and len(failed.attempts) == 3
    assert len(always.released) == 3  # every lost sandbox was still released


def test_dirty_sandbox_and_broken_task_are_not_scored() -> None:
    dirty = Grader(FakeAcquire({"apply_exit": 10}), CFG).grade(task(), b"")
    assert dirty.verdict is Verdict.INFRA_ERROR
    assert dirty.infra_kind == "grading_sandbox_rejected"
    broken = Grader(FakeAcquire({"apply_exit": 30}), CFG).grade(task(), b"")
    assert broken.verdict is Verdict.INFRA_ERROR and broken.infra_kind == "task_error"
    assert len(broken.attempts) == 1  # a broken task is not retried


def test_declared_timeout_is_sent_and_probe_contradiction_refuses() -> None:
    spec = load_task(SWE / "specs" / "swebench-style.json")
    fake = FakeAcquire({"observed": observed(), "run": GOOD_RUN})
    Grader(fake, CFG).grade(spec, b"")
    assert fake.scripts[0]["test_timeout"] == 120.0
    allowed = observed(egress={"state": "allowed", "reason": "verified TLS handshake"})
    refused = Grader(FakeAcquire({"observed": allowed}), CFG).grade(spec, spec.reference_patch)
    assert refused.verdict is Verdict.INFRA_ERROR
    assert refused.infra_kind == "probe_contradiction"
    assert refused.probe is not None and refused.probe["contradictions"] == ["egress"]


def test_test_file_sections_are_dropped_before_grading() -> None:
    fake = FakeAcquire({"run": BAD_RUN})
    patch = (SWE / "specs" / "tests-edit.patch").read_bytes()
    result = Grader(fake, CFG).grade(task(), patch)
    assert set(result.dropped_files) == {"tests/test_stats.py", "tests/conftest.py"}
    assert result.patch_files == []


def test_preflight_classification() -> None:
    def r(v: Verdict) -> GradeResult:
        return GradeResult("t", v, "")

    ok, un, infra = Verdict.RESOLVED, Verdict.UNRESOLVED, Verdict.INFRA_ERROR
    assert classify(r(ok), r(un)) == "ok"
    assert classify(r(un), r(un)) == "reference_fails"
    assert classify(r(ok), r(ok)) == "empty_passes"
    assert classify(r(un), r(ok)) == "reference_fails_and_empty_passes"
    assert classify(r(infra), r(un)) == "infra_error"
