"""What grading returns: a verdict that never mixes infrastructure with test outcomes.

``resolved`` and ``unresolved`` are verdicts about the patch; ``infra_error`` means the
grading itself could not be carried out (sandbox lost, acquire timeout, a probe
contradiction, a broken task) after the bounded retries, so ``reward`` is None and a
trainer must mask the sample instead of scoring it zero.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Verdict(enum.StrEnum):
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"
    INFRA_ERROR = "infra_error"


@dataclass
class Attempt:
    number: int
    outcome: str  # graded | infra_error
    sandbox_id: str | None = None
    error_kind: str | None = None  # the error's code, e.g. sandbox_lost, probe_contradiction
    error: str | None = None
    reused: bool = False
    durations: dict[str, float] = field(default_factory=dict)


@dataclass
class GradeResult:
    task_id: str
    verdict: Verdict
    reason: str
    tests: dict[str, str] = field(default_factory=dict)  # every parsed test -> outcome
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    probe: dict[str, Any] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    duration_s: float = 0.0
    patch_sha256: str = ""
    patch_files: list[str] = field(default_factory=list)
    # Paths whose agent changes were dropped by the test-path rule (sorted); see
    # broker/grading/testrules.py. Non-empty on a candidate = it touched the tests.
    dropped_files: list[str] = field(default_factory=list)
    # Run conditions a failure shows (egress, timeout, oom, probe_contradiction); see
    # broker/grading/attribution.py. Empty: the patch's own failure (or no failure).
    attribution: list[str] = field(default_factory=list)
    test_exit_code: int | None = None
    test_timed_out: bool = False
    output_tail: str = ""
    infra_kind: str | None = None
    # Harbor tasks: the verifier's own reward (may be fractional; resolved = full reward
    # 1.0) and what was read: reward_file, metrics, test_exit_code.
    score: float | None = None
    verifier: dict[str, Any] | None = None

    @property
    def reward(self) -> float | None:
        """1.0 / 0.0 for a verdict on the patch (a Harbor verifier's reward as it wrote
        it); None for infra_error (mask the sample)."""
        if self.verdict is Verdict.INFRA_ERROR:
            return None
        if self.score is not None:
            return self.score
        return 1.0 if self.verdict is Verdict.RESOLVED else 0.0

    @property
    def is_infrastructure_failure(self) -> bool:
        return self.verdict is Verdict.INFRA_ERROR

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        data["reward"] = self.reward
        return data
