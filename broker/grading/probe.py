"""Run the in-pod probe and decide, field by field, whether the pod matches the task.

Decision rules (one per declared field; undeclared fields are reported, never checked):
- timeout_s: the grader's own exec timeout must equal the declaration (a grader that
  sends no timeout, or a shorter/longer one, contradicts it).
- pythonhashseed: the probe's environment (the same shell the tests use) must carry the
  declared seed; "random" contradicts any fixed seed.
- memory: the effective cgroup limit (the minimum along the cgroup path) must equal the
  declaration within 1%; "unlimited" contradicts a declared limit.
- cpus: the cgroup CPU quota must equal the declaration within 0.01 CPU.
- visible_cpus: sched_getaffinity must show exactly that many CPUs.
- min_cpus (checked only when declared): "at least": the CPUs the tests can use, the
  cgroup quota capped by the visible CPUs (the visible CPUs alone when the quota is
  unlimited), must be >= the declaration (within 0.01 CPU).
- min_memory (only when declared): the cgroup limit must be >= the declaration (within
  1%); unlimited satisfies it.
- egress: "denied" needs no DNS answer or no TLS handshake (a TLS answer without a
  valid certificate means something outside answers: contradiction); "allowed" needs a
  verified TLS handshake with the expected name.
- tz: TZ must be set to the declared zone, the zone must be known in the sandbox and
  the C library's UTC offset must match it (glibc silently falls back to UTC).
- locale: LC_ALL/LANG must name the declared locale and setlocale() must accept it.
A field the probe could not read is "unreadable": listed in the report, not passed as ok.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from broker.errors import InfrastructureError, PermanentError, TemporaryError
from broker.grading.seam import GradingSandbox
from broker.grading.spec import Conditions

UTC_NAMES = frozenset({"UTC", "UTC0", "GMT", "GMT0"})
# A POSIX TZ without a DST rule (``IST-5:30``, ``JST-9``, ``<+0530>-5:30``): the C library
# reads it without zone data. Its offset is west of UTC, so the UTC offset is its negation.
_POSIX_TZ = re.compile(
    r"(?:[A-Za-z]{3,}|<[A-Za-z0-9+-]{3,}>)([+-]?)(\d{1,2})(?::(\d{2}))?(?::(\d{2}))?"
)
MARKER = "SANDMAN-PROBE "


class ProbeContradiction(InfrastructureError, PermanentError):
    """The grading pod does not match the task's declared run conditions: not graded."""

    code = "probe_contradiction"

    def __init__(self, report: ProbeReport) -> None:
        self.report = report
        lines = "; ".join(f"{c.field}: {c.detail}" for c in report.contradictions)
        super().__init__(f"run conditions contradict the task: {lines}")


class ProbeFailed(InfrastructureError, TemporaryError):
    code = "probe_failed"


@dataclass(frozen=True)
class FieldCheck:
    field: str
    status: str  # ok | contradiction | unreadable | not_declared
    declared: Any
    observed: Any
    detail: str

    def line(self) -> str:
        """E.g. ``egress: denied (no DNS answer)``; non-ok statuses are suffixed."""
        suffix = "" if self.status in ("ok", "not_declared") else f" [{self.status}]"
        return f"{self.field}: {self.detail}{suffix}"


@dataclass
class ProbeReport:
    checks: list[FieldCheck]
    observed: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def contradictions(self) -> list[FieldCheck]:
        return [c for c in self.checks if c.status == "contradiction"]

    @property
    def unreadable(self) -> list[FieldCheck]:
        return [c for c in self.checks if c.status == "unreadable"]

    def ok(self, *, refuse_unreadable: bool = False) -> bool:
        return not self.contradictions and not (refuse_unreadable and self.unreadable)

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines(),
            "checks": [asdict(c) for c in self.checks],
            "contradictions": [c.field for c in self.contradictions],
            "unreadable": [c.field for c in self.unreadable],
            "duration_s": round(self.duration_s, 3),
            "observed": self.observed,
        }


def probe_source() -> str:
    return resources.files("broker.grading").joinpath("probe_inpod.py").read_text()


def run_probe(
    sandbox: GradingSandbox,
    declared: Conditions,
    *,
    grader_timeout_s: float | None,
    egress_host: str = "example.com",
    egress_timeout_s: float = 3.0,
    workdir: str = "/tmp",  # noqa: S108 (inside the sandbox; the grader passes its own)
) -> ProbeReport:
    """Send the probe through execd, run it in the tests' shell, and decide."""
    started = time.monotonic()
    path = f"{workdir}/sandman-probe-{sandbox.id[:16]}.py"
    sandbox.write_file(path, probe_source())
    args = json.dumps({"egress_host": egress_host, "egress_timeout_s": egress_timeout_s})
    result = sandbox.exec(
        f"python3 {shlex.quote(path)} {shlex.quote(args)}; rm -f -- {shlex.quote(path)}",
        timeout=4 * egress_timeout_s + 30,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(MARKER)]
    if not lines:
        detail = (result.stderr or result.stdout)[-1000:]
        raise ProbeFailed(f"probe printed no report (exit {result.exit_code}): {detail}")
    observed: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    checks = decide(declared, observed, grader_timeout_s=grader_timeout_s)
    return ProbeReport(checks, observed, time.monotonic() - started)


def decide(
    declared: Conditions, observed: dict[str, Any], *, grader_timeout_s: float | None
) -> list[FieldCheck]:
    """One FieldCheck per condition, in a fixed order (the "at least" fields only when
    declared: most tasks never use them)."""
    checks = [
        _timeout(declared.timeout_s, grader_timeout_s),
        _seed(declared.pythonhashseed, observed),
        _memory(declared.memory_b, observed.get("memory") or {}),
        _cpus(declared.cpus, observed.get("cpu") or {}),
        _visible(declared.visible_cpus, observed.get("cpu") or {}),
        _egress(declared.egress, observed.get("egress") or {}),
        _tz(declared.tz, observed.get("tz") or {}),
        _locale(declared.locale, observed.get("locale") or {}),
    ]
    if declared.min_memory_b is not None:
        checks.append(_min_memory(declared.min_memory_b, observed.get("memory") or {}))
    if declared.min_cpus is not None:
        checks.append(_min_cpus(declared.min_cpus, observed.get("cpu") or {}))
    return checks


def _check(name: str, declared: Any, observed: Any, bad: bool, detail: str) -> FieldCheck:
    if declared is None:
        return FieldCheck(name, "not_declared", None, observed, detail)
    status = "contradiction" if bad else "ok"
    return FieldCheck(name, status, declared, observed, detail)


def _timeout(declared: float | None, grader: float | None) -> FieldCheck:
    shown = "none" if grader is None else f"{grader:g}s"
    bad = grader is None or (declared is not None and abs(grader - declared) > 1.0)
    return _check("timeout_s", declared, grader, bad, f"grader sends {shown}")


def _seed(declared: str | None, obs: dict[str, Any]) -> FieldCheck:
    env = obs.get("env")
    if not isinstance(env, dict):
        return FieldCheck("pythonhashseed", "unreadable", declared, None, "probe saw no env")
    seed = env.get("PYTHONHASHSEED")
    shown = "random (unset)" if seed in (None, "", "random") else seed
    bad = shown != "random (unset)" if declared == "random" else seed != declared
    return _check("pythonhashseed", declared, seed, bad, f"PYTHONHASHSEED={shown}")


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}GiB"


def _memory(declared: int | None, obs: dict[str, Any]) -> FieldCheck:
    if not obs.get("readable"):
        reason = obs.get("error", "not readable")
        return FieldCheck("memory", "unreadable", declared, None, f"unreadable ({reason})")
    limit = obs.get("limit_b")
    shown = "unlimited" if limit is None else _gib(limit)
    src = f"cgroup {obs.get('cgroup')}"
    if declared is None:
        return _check("memory", None, limit, False, f"limit {shown} ({src})")
    bad = limit is None or abs(limit - declared) > declared * 0.01
    return _check("memory", declared, limit, bad, f"limit {shown}, declared {_gib(declared)}")


def _cpus(declared: float | None, obs: dict[str, Any]) -> FieldCheck:
    if not obs.get("quota_readable"):
        return FieldCheck("cpus", "unreadable", declared, None, "unreadable (no cgroup cpu quota)")
    quota = obs.get("quota_cpus")
    shown = "unlimited" if quota is None else f"{quota:g}"
    bad = declared is not None and (quota is None or abs(quota - declared) > 0.01)
    return _check("cpus", declared, quota, bad, f"cgroup quota {shown} CPUs")


def _visible(declared: int | None, obs: dict[str, Any]) -> FieldCheck:
    visible = obs.get("visible")
    if visible is None:
        return FieldCheck("visible_cpus", "unreadable", declared, None, "unreadable (affinity)")
    bad = declared is not None and visible != declared
    return _check("visible_cpus", declared, visible, bad, f"{visible} CPUs visible (affinity)")


def _min_memory(declared: int, obs: dict[str, Any]) -> FieldCheck:
    if not obs.get("readable"):
        reason = obs.get("error", "not readable")
        return FieldCheck("min_memory", "unreadable", declared, None, f"unreadable ({reason})")
    limit = obs.get("limit_b")
    shown = "unlimited" if limit is None else _gib(limit)
    bad = limit is not None and limit < declared * 0.99
    return _check("min_memory", declared, limit, bad, f"limit {shown}, at least {_gib(declared)}")


def _min_cpus(declared: float, obs: dict[str, Any]) -> FieldCheck:
    quota = obs.get("quota_cpus") if obs.get("quota_readable") else None
    visible = obs.get("visible")
    usable = [n for n in (quota, visible) if n is not None]
    if not usable:
        detail = "unreadable (no cpu quota and no affinity)"
        if obs.get("quota_readable") and visible is None:
            detail = "unreadable (quota unlimited, affinity unreadable)"
        return FieldCheck("min_cpus", "unreadable", declared, None, detail)
    have = min(usable)
    shown = f"quota {'unlimited' if quota is None else f'{quota:g}'}, {visible} visible"
    bad = have < declared - 0.01
    return _check("min_cpus", declared, have, bad, f"{have:g} CPUs usable ({shown})")


def _egress(declared: str | None, obs: dict[str, Any]) -> FieldCheck:
    state = obs.get("state")
    if state is None:
        return FieldCheck("egress", "unreadable", declared, None, "unreadable (probe failed)")
    detail = f"{state} ({obs.get('reason')})"
    bad = declared is not None and state != declared
    return _check("egress", declared, state, bad, detail)


def _tz(declared: str | None, obs: dict[str, Any]) -> FieldCheck:
    env, offset = obs.get("env"), obs.get("utcoffset_s")
    names = "/".join(obs.get("tzname") or [])
    detail = f"TZ={env or '(unset)'}, libc zone {names} offset {offset}s"
    if declared is None:
        return _check("tz", None, env, False, detail)
    if env != declared:
        return _check("tz", declared, env, True, detail + f", declared {declared}")
    expected = obs.get("expected_offset_s")
    if expected is None and declared.lstrip(":") in UTC_NAMES:
        expected = 0
    if expected is None:
        expected = posix_offset_s(declared)
    if expected is None:
        if obs.get("zone_file") is False or obs.get("zone_error"):
            return _check("tz", declared, env, True, detail + ": zone data missing in sandbox")
        return FieldCheck("tz", "unreadable", declared, env, detail + ": offset not checkable")
    bad = expected != offset
    return _check("tz", declared, env, bad, detail + f", zone expects {expected}s")


def posix_offset_s(tz: str) -> int | None:
    """The UTC offset of a fixed POSIX TZ (``IST-5:30`` -> 19800), None for anything else."""
    m = _POSIX_TZ.fullmatch(tz)
    if m is None:
        return None
    sign, hours, minutes, seconds = m.groups()
    west = int(hours) * 3600 + int(minutes or 0) * 60 + int(seconds or 0)
    return west if sign == "-" else -west


def _locale(declared: str | None, obs: dict[str, Any]) -> FieldCheck:
    effective = obs.get("LC_ALL") or obs.get("LANG")
    detail = f"LC_ALL/LANG={effective or '(unset)'}, setlocale " + (
        "ok" if obs.get("available") else f"failed ({obs.get('error')})"
    )
    bad = declared is not None and (effective != declared or not obs.get("available"))
    return _check("locale", declared, effective, bad, detail)
