"""The grading path: task specs, patch extraction, run-condition probe, grading, preflight.

See docs/grading.md. Public API::

    from broker.grading import GradingClient, grade, agrade, load_task, extract_patch
"""

from broker.grading.api import GradingClient, agrade, broker_acquire, grade
from broker.grading.grade import GradeConfig, Grader
from broker.grading.patch import ExtractedPatch, PatchExtractionError, extract_patch
from broker.grading.preflight import PreflightEntry, PreflightOptions, run_preflight
from broker.grading.results import GradeResult, Verdict
from broker.grading.spec import TaskSpec, TaskSpecError, load_task

__all__ = [
    "ExtractedPatch",
    "GradeConfig",
    "GradeResult",
    "Grader",
    "GradingClient",
    "PatchExtractionError",
    "PreflightEntry",
    "PreflightOptions",
    "TaskSpec",
    "TaskSpecError",
    "Verdict",
    "agrade",
    "broker_acquire",
    "extract_patch",
    "grade",
    "load_task",
    "run_preflight",
]
