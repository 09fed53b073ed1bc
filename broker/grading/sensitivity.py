"""Load-bearing conditions: which run conditions the reference's verdict depends on.

Preflight proves a task at one configuration. A task whose reference passes only with
``PYTHONHASHSEED=0``, only in UTC or only with two visible CPUs is ``ok`` there, and a
later change of runner (a dropped env var, a one-CPU node) silently flips its rewards.
So ``preflight --sensitivity`` grades the reference again under perturbed conditions,
one condition at a time (the others as declared):

- ``pythonhashseed``: other seeds, including unset (``random``);
- ``tz``: a zone with a non-zero offset (the POSIX TZ ``IST-5:30`` needs no zone data);
- ``visible_cpus``: one visible CPU (a declared ``min_cpus`` is dropped for that run);
- ``egress``: the opposite policy as the grading sandbox's own (``SandboxRequest.egress``),
  where it can be given: a caller that knows it cannot says so up front
  (``EgressSupport``); otherwise the broker decides, and a sandbox it refuses (no egress
  guard on the backend: ``guard_missing``; a job that denies egress:
  ``egress_not_permitted``) or that does not get it (the probe contradicts it) makes the
  run ``not_tested`` with the reason, never a flip.

A condition is load-bearing when a perturbation flips the reference's verdict
(``infra_error`` runs never count as a flip). A load-bearing condition the task did not
declare is an ``undeclared_dependency``: nothing enforces it, so the reward depends on
whatever the runner happens to provide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from broker.grading.results import GradeResult, Verdict
from broker.grading.spec import Conditions, TaskSpec

SEEDS = ("0", "1", "4242", "random")  # "random" = PYTHONHASHSEED unset
OTHER_TZ = "IST-5:30"  # UTC+05:30, POSIX: no zone data needed
FALLBACK_TZ = "UTC"  # for a task that declares OTHER_TZ itself
KEYS = ("pythonhashseed", "tz", "visible_cpus", "egress")

# Given the egress state to test ("allowed"/"denied"), None to try it, else the reason
# it cannot be given.
EgressSupport = Callable[[str], str | None]
# A perturbed egress run that ends in one of these was not given that egress.
EGRESS_REFUSALS = frozenset({"guard_missing", "egress_not_permitted", "probe_contradiction"})


def try_egress(_state: str) -> str | None:
    """Ask the broker for it: its guard decides (see ``EGRESS_REFUSALS``)."""
    return None


@dataclass(frozen=True)
class Perturbation:
    key: str  # the spec's condition name
    value: str
    conditions: Conditions | None  # None: not tested (see reason)
    reason: str = ""


@dataclass
class SensitivityRun:
    key: str
    value: str
    status: str  # flipped | same | infra_error | not_tested
    verdict: str | None = None
    flipped_tests: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass
class Sensitivity:
    load_bearing: list[str]
    flipped_tests: dict[str, list[str]]
    undeclared_dependency: list[str]
    runs: list[SensitivityRun]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def perturbations(
    declared: Conditions, observed_egress: str | None, egress: EgressSupport
) -> list[Perturbation]:
    """One condition changed per run, the others as declared."""
    out: list[Perturbation] = []
    current_seed = declared.pythonhashseed or "random"
    for seed in [s for s in SEEDS if s != current_seed][:3]:
        label = "unset" if seed == "random" else seed
        out.append(Perturbation("pythonhashseed", label, replace(declared, pythonhashseed=seed)))
    tz = FALLBACK_TZ if declared.tz == OTHER_TZ else OTHER_TZ
    out.append(Perturbation("tz", tz, replace(declared, tz=tz)))
    if declared.visible_cpus == 1:
        out.append(Perturbation("visible_cpus", "1", None, "the task declares 1 already"))
    else:
        one = replace(declared, visible_cpus=1, min_cpus=None)
        out.append(Perturbation("visible_cpus", "1", one))
    current = declared.egress or observed_egress
    if current not in ("allowed", "denied"):
        out.append(Perturbation("egress", "?", None, "the current egress state is unknown"))
    else:
        other = "allowed" if current == "denied" else "denied"
        why = egress(other)
        cond = replace(declared, egress=other) if why is None else None
        out.append(Perturbation("egress", other, cond, why or ""))
    return out


def _outcomes(result: GradeResult) -> dict[str, str]:
    return {**result.tests, **result.fail_to_pass, **result.pass_to_pass}


def flipped_tests(base: GradeResult, other: GradeResult) -> list[str]:
    a, b = _outcomes(base), _outcomes(other)
    return sorted(n for n in {*a, *b} if a.get(n, "missing") != b.get(n, "missing"))


def analyse(
    task: TaskSpec,
    reference: GradeResult,
    grade: Callable[[TaskSpec], GradeResult],
    egress: EgressSupport = try_egress,
) -> Sensitivity:
    """Grade the reference under each perturbation (``grade`` grades it for a spec)."""
    observed = ((reference.probe or {}).get("observed") or {}).get("egress") or {}
    runs: list[SensitivityRun] = []
    for p in perturbations(task.conditions, observed.get("state"), egress):
        if p.conditions is None:
            runs.append(SensitivityRun(p.key, p.value, "not_tested", reason=p.reason))
            continue
        result = grade(replace(task, conditions=p.conditions))
        if p.key == "egress" and result.infra_kind in EGRESS_REFUSALS:
            why = f"the grading sandbox was not given egress {p.value}: {result.reason}"
            runs.append(SensitivityRun(p.key, p.value, "not_tested", reason=why[:1000]))
            continue
        if result.verdict is Verdict.INFRA_ERROR:
            runs.append(
                SensitivityRun(p.key, p.value, "infra_error", "infra_error", [], result.reason)
            )
            continue
        flipped = result.verdict is not reference.verdict
        runs.append(
            SensitivityRun(
                p.key,
                p.value,
                "flipped" if flipped else "same",
                result.verdict.value,
                flipped_tests(reference, result),
                result.reason if flipped else "",
            )
        )
    tests: dict[str, list[str]] = {}
    for run in runs:
        if run.status == "flipped":
            tests[run.key] = sorted({*tests.get(run.key, []), *run.flipped_tests})
    load_bearing = [k for k in KEYS if k in tests]
    declared = task.conditions.declared()
    undeclared = [k for k in load_bearing if k not in declared]
    return Sensitivity(load_bearing, tests, undeclared, runs)
