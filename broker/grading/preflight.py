"""Preflight: under a job's configuration, the reference patch must pass and the empty
patch must fail. Tasks that do neither cannot tell a fix from no fix (or depend on run
conditions) and are listed for exclusion.

This checks what can be checked at one configuration: it does not catch condition
effects that only an agent's patch triggers (the paper's caveat), so it is re-run per
job configuration. Infrastructure failures are reported as such and never exclude a
task: re-run them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from broker.errors import SandmanError
from broker.grading import harbor
from broker.grading.grade import Grader
from broker.grading.patch import ExtractedPatch, extract_patch
from broker.grading.results import GradeResult, Verdict
from broker.grading.sensitivity import EgressSupport, analyse, try_egress
from broker.grading.spec import TaskSpec

log = logging.getLogger(__name__)
EXCLUDED_STATUSES = frozenset(
    {
        "reference_fails",
        "empty_passes",
        "reference_fails_and_empty_passes",
        "no_reference",
        "invalid",
    }
)


@dataclass
class PreflightEntry:
    task_id: str
    status: str
    source: str | None = None
    reference: dict[str, Any] = field(default_factory=dict)
    empty: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    # --sensitivity only (None without it): the condition keys whose perturbation flips
    # the reference's verdict, the tests each flips, the load-bearing keys the task does
    # not declare, and every perturbed run (broker/grading/sensitivity.py).
    load_bearing: list[str] | None = None
    load_bearing_tests: dict[str, list[str]] | None = None
    undeclared_dependency: list[str] | None = None
    sensitivity: list[dict[str, Any]] | None = None

    @property
    def excluded(self) -> bool:
        return self.status in EXCLUDED_STATUSES


def _brief(result: GradeResult) -> dict[str, Any]:
    return {
        "verdict": result.verdict.value,
        "reason": result.reason,
        "reward": result.reward,
        "fail_to_pass": result.fail_to_pass,
        "pass_to_pass": result.pass_to_pass,
        "attempts": len(result.attempts),
        "infra_kind": result.infra_kind,
        "attribution": result.attribution,
        "dropped_files": result.dropped_files,
        "probe_contradictions": (result.probe or {}).get("contradictions", []),
        "duration_s": round(result.duration_s, 3),
    }


def classify(reference: GradeResult, empty: GradeResult) -> str:
    if Verdict.INFRA_ERROR in (reference.verdict, empty.verdict):
        return "infra_error"
    ref_ok = reference.verdict is Verdict.RESOLVED
    empty_ok = empty.verdict is Verdict.UNRESOLVED
    if ref_ok and empty_ok:
        return "ok"
    if not ref_ok and not empty_ok:
        return "reference_fails_and_empty_passes"
    return "empty_passes" if ref_ok else "reference_fails"


@dataclass(frozen=True)
class PreflightOptions:
    sensitivity: bool = False  # also grade the reference under perturbed conditions
    egress: EgressSupport = try_egress  # None: try that egress; else why it cannot be had


def preflight_task(
    grader: Grader, task: TaskSpec, options: PreflightOptions | None = None
) -> PreflightEntry:
    started = time.monotonic()
    opts = options or PreflightOptions()
    if task.reference_patch is None and not (task.harbor and task.harbor.solution):
        return PreflightEntry(task.task_id, "no_reference", task.source)
    try:
        fix = task.reference_patch if task.harbor is None else solution_patch(grader, task)
        reference = grader.grade(task, fix)
        empty = grader.grade(task, b"")
        entry = PreflightEntry(
            task.task_id,
            classify(reference, empty),
            task.source,
            reference=_brief(reference),
            empty=_brief(empty),
        )
        if opts.sensitivity and reference.verdict is not Verdict.INFRA_ERROR:
            found = analyse(task, reference, lambda t: grader.grade(t, fix), opts.egress)
            entry.load_bearing = found.load_bearing
            entry.load_bearing_tests = found.flipped_tests
            entry.undeclared_dependency = found.undeclared_dependency
            entry.sensitivity = [asdict(r) for r in found.runs]
    except SandmanError as exc:  # e.g. UnknownJob, an image the broker refuses
        message = f"{type(exc).__name__}: {exc}"
        return PreflightEntry(task.task_id, "error", task.source, errors=[message])
    entry.duration_s = time.monotonic() - started
    return entry


def solution_patch(grader: Grader, task: TaskSpec) -> ExtractedPatch:
    """A Harbor task's reference: ``solution/solve.sh`` run in a rollout sandbox of the
    task image (as an agent would work), its changes extracted like an agent's."""
    assert task.harbor is not None
    request = replace(grader.request_for(task), role="rollout", visible_cpus=None)
    timeout = task.harbor.agent_timeout_s or grader.timeout_for(task)
    with grader.acquire(request) as sandbox:
        harbor.stage(sandbox, harbor.SOLUTION_DIR, task.harbor.solution)
        out = sandbox.exec(harbor.solution_script(task, task.harbor), timeout=timeout)
        if out.exit_code != 0 or out.timed_out:
            detail = (out.stderr or out.stdout).strip()[-500:]
            log.warning("%s: solve.sh exited %s: %s", task.task_id, out.exit_code, detail)
        return extract_patch(sandbox, task)


def run_preflight(
    grader: Grader,
    tasks: list[TaskSpec],
    *,
    parallel: int = 4,
    on_done: Callable[[PreflightEntry], None] | None = None,
    options: PreflightOptions | None = None,
) -> list[PreflightEntry]:
    """Every task in parallel (each grading acquires its own sandbox through the broker)."""
    entries: list[PreflightEntry] = []
    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="preflight") as pool:
        futures = [pool.submit(preflight_task, grader, task, options) for task in tasks]
        for future in as_completed(futures):
            entry = future.result()
            entries.append(entry)
            if on_done is not None:
                on_done(entry)
    order = {t.task_id: i for i, t in enumerate(tasks)}
    return sorted(entries, key=lambda e: order.get(e.task_id, len(order)))


def write_reports(
    entries: list[PreflightEntry], out_dir: Path, *, meta: dict[str, Any], exclude_file: Path
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.status] = counts.get(e.status, 0) + 1
    doc = {
        "generated_at": dt.datetime.now(dt.UTC).isoformat(),
        "meta": meta,
        "counts": counts,
        "excluded": [e.task_id for e in entries if e.excluded],
        "tasks": [{**asdict(e), "excluded": e.excluded} for e in entries],
    }
    json_path, md_path = out_dir / "preflight.json", out_dir / "preflight.md"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md_path.write_text(markdown(entries, meta, counts))
    exclude_file.parent.mkdir(parents=True, exist_ok=True)
    exclude_file.write_text("".join(f"{e.task_id}\n" for e in entries if e.excluded))
    return {"json": json_path, "markdown": md_path, "exclude": exclude_file}


def markdown(entries: list[PreflightEntry], meta: dict[str, Any], counts: dict[str, int]) -> str:
    lines = ["# Preflight report", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["- counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    lines += [
        "| task | status | excluded | reference | empty | load-bearing | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        ref = e.reference.get("verdict", "-")
        emp = e.empty.get("verdict", "-")
        lines.append(
            f"| `{e.task_id}` | {e.status} | {'yes' if e.excluded else 'no'} | {ref} | {emp} "
            f"| {_load_bearing_cell(e)} | {e.duration_s:.1f} |"
        )
    problems = [e for e in entries if e.status != "ok" or e.load_bearing]
    if problems:
        lines += ["", "## Details", ""]
    for e in problems:
        lines.append(f"### `{e.task_id}`: {e.status}")
        for err in e.errors:
            lines.append(f"- error: {err}")
        for name, part in (("reference", e.reference), ("empty", e.empty)):
            if part:
                lines.append(f"- {name}: {part.get('verdict')}: {part.get('reason')}")
                if part.get("attribution"):
                    lines.append(f"  - attributed to: {', '.join(part['attribution'])}")
                if part.get("dropped_files"):
                    dropped = ", ".join(f"`{p}`" for p in part["dropped_files"])
                    lines.append(f"  - dropped by the test-path rule: {dropped}")
        lines += _sensitivity_lines(e)
        lines.append("")
    return "\n".join(lines) + "\n"


def _load_bearing_cell(e: PreflightEntry) -> str:
    if e.load_bearing is None:
        return "-"
    undeclared = set(e.undeclared_dependency or [])
    return (
        ", ".join(f"{k} (undeclared)" if k in undeclared else k for k in e.load_bearing) or "none"
    )


def _sensitivity_lines(e: PreflightEntry) -> list[str]:
    lines: list[str] = []
    tests = e.load_bearing_tests or {}
    for key in e.load_bearing or []:
        note = " (undeclared_dependency)" if key in (e.undeclared_dependency or []) else ""
        values = [
            r["value"] for r in e.sensitivity or [] if r["key"] == key and r["status"] == "flipped"
        ]
        names = ", ".join(f"`{t}`" for t in tests.get(key, [])) or "no per-test change"
        lines.append(
            f"- load-bearing `{key}`{note}: flipped at {', '.join(values)}; tests: {names}"
        )
    for r in e.sensitivity or []:
        if r["status"] in ("not_tested", "infra_error"):
            lines.append(f"- `{r['key']}` {r['status']}: {r['reason']}")
    return lines
