"""Grade one patch for one task: fresh grading sandbox -> probe -> apply -> tests -> verdict.

The protocol, per attempt:
1. acquire a sandbox with role "grading" (never the rollout's; a reused one only when
   the config allows it), with the declared environment (hash seed, TZ, locale);
2. probe the run conditions inside it and refuse on a contradiction;
3. check the worktree is pristine at the base commit, apply the agent patch (test-path
   sections already dropped on the broker side, ``broker.grading.testrules``), restore
   the test files and every dropped path from the base commit and apply the task's
   test patch;
4. run the test command with the declared timeout, judge its output
   (``broker.grading.judge``: per-test outcomes, verdict) and
   attribute a failure to a run condition where the evidence shows one
   (``broker.grading.attribution``);
5. release (always).
The grader's files in the sandbox (patches, the probe) live in a fresh ``mktemp -d``
directory per grading, removed afterwards: gradings that share a ``/tmp`` (direct mode,
a reused sandbox) never read each other's patches.
Infrastructure failures (typed ``InfrastructureError``) are retried a bounded number of
times with a fresh sandbox and, if they persist, reported as ``infra_error``: never as a
failed patch. A patch that does not apply is the patch's fault: ``unresolved``.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from broker.errors import (
    ExecError,
    InfrastructureError,
    PermanentError,
    SandmanError,
    TemporaryError,
)
from broker.grading import attribution, harbor
from broker.grading.judge import judge
from broker.grading.patch import ExtractedPatch, is_excluded
from broker.grading.patchfmt import filter_patch, patch_paths
from broker.grading.probe import ProbeContradiction, ProbeReport, run_probe
from broker.grading.results import Attempt, GradeResult, Verdict
from broker.grading.seam import Acquire, GradingSandbox, SandboxRequest
from broker.grading.spec import TaskSpec
from broker.wire.validation import parse_memory

log = logging.getLogger(__name__)
WORK_MARKER = "SANDMAN-WORK"
OOM_MARKER = "SANDMAN-OOM-KILLS"
# The oom_kill counter of the cgroup the shell runs in (cgroup v2; v1 kernels >= 4.13
# print it in memory.oom_control). Prints nothing when unreadable.
OOM_KILLS = (
    "p=$(sed -n 's/^0:://p' /proc/self/cgroup 2>/dev/null | head -n 1); "
    'for f in "/sys/fs/cgroup$p/memory.events" /sys/fs/cgroup/memory.events '
    "/sys/fs/cgroup/memory/memory.oom_control; do "
    '[ -r "$f" ] && { sed -n "s/^oom_kill /' + OOM_MARKER + ' /p" "$f"; break; }; done'
)


class GradingSandboxRejected(InfrastructureError, TemporaryError):
    """The sandbox handed out cannot be used for grading (dirty, reused when not allowed)."""

    code = "grading_sandbox_rejected"


class TaskError(PermanentError):
    """The task itself is broken (its test patch does not apply): not the agent's fault."""

    code = "task_error"


@dataclass(frozen=True)
class GradeConfig:
    max_attempts: int = 3
    retry_backoff_s: float = 1.0
    default_timeout_s: float = 1800.0  # when the task declares no timeout
    cpu: float = 1.0  # when the task declares no cpus
    memory: str | int = "2Gi"  # when the task declares no memory
    acquire_timeout_s: float = 600.0
    egress_host: str = "example.com"
    egress_timeout_s: float = 3.0
    refuse_unreadable: bool = False
    allow_reuse: bool = False
    output_tail_chars: int = 8000
    max_output_bytes: int = 8 << 20


def as_patch_bytes(patch: bytes | str | ExtractedPatch | None) -> bytes:
    if patch is None:
        return b""
    if isinstance(patch, ExtractedPatch):
        return patch.patch
    return patch.encode() if isinstance(patch, str) else patch


def apply_script(
    task: TaskSpec, agent_patch: str, test_patch: str, dropped: list[str] | tuple[str, ...] = ()
) -> str:
    """Pristine check, agent patch, test paths back to the base commit, test patch."""
    q = shlex.quote
    restore = "\n".join(
        f'if g cat-file -e "$B":{q(f)} 2>/dev/null; then g checkout -q "$B" -- {q(f)} || exit 30; '
        f"else rm -rf -- {q(f)}; fi"
        for f in dict.fromkeys([*task.test_files, *dropped])
    )
    return f"""
R={q(task.repo_path)}
cd "$R" || {{ echo "no repository at $R" >&2; exit 10; }}
B={q(task.base_commit)}
g() {{ git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*' "$@"; }}
head=$(g rev-parse --verify -q 'HEAD^{{commit}}')
[ "$head" = "$B" ] || {{ echo "HEAD is $head, not $B" >&2; exit 10; }}
dirty=$(g status --porcelain --untracked-files=all | head -n 5)
[ -z "$dirty" ] || {{ echo "worktree not pristine: $dirty" >&2; exit 10; }}
if [ -s {q(agent_patch)} ]; then g apply --whitespace=nowarn {q(agent_patch)} || exit 20; fi
{restore}
if [ -s {q(test_patch)} ]; then g apply --whitespace=nowarn {q(test_patch)} || exit 30; fi
{OOM_KILLS}
echo SANDMAN-APPLIED
"""


class Grader:
    """Grades patches through an injectable ``Acquire`` (the broker, or execd directly)."""

    def __init__(
        self,
        acquire: Acquire,
        config: GradeConfig | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.acquire = acquire
        self.config = config or GradeConfig()
        self.sleep = sleep

    def request_for(self, task: TaskSpec) -> SandboxRequest:
        c = task.conditions
        return SandboxRequest(
            image=task.image_ref,
            cpu=c.cpus if c.cpus is not None else max(self.config.cpu, c.min_cpus or 0.0),
            memory_b=(
                c.memory_b
                if c.memory_b is not None
                else max(parse_memory(self.config.memory), c.min_memory_b or 0)
            ),
            env=c.env(),
            workdir=task.repo_path,
            base_commit=task.base_commit,
            image_digest=task.image_digest,
            role="grading",
            timeout_s=self.config.acquire_timeout_s,
            visible_cpus=c.visible_cpus,
            egress={"denied": "deny", "allowed": "allow"}.get(c.egress or ""),
        )

    def timeout_for(self, task: TaskSpec) -> float:
        declared = task.conditions.timeout_s
        return declared if declared is not None else self.config.default_timeout_s

    def grade(self, task: TaskSpec, patch: bytes | str | ExtractedPatch | None) -> GradeResult:
        started = time.monotonic()
        raw = as_patch_bytes(patch)
        earlier = patch.dropped if isinstance(patch, ExtractedPatch) else []
        try:
            kept, dropped = filter_patch(raw, lambda p: is_excluded(task, p))
            dropped = sorted({*earlier, *dropped})
            files = patch_paths(kept)
        except ValueError as exc:
            return GradeResult(
                task.task_id, Verdict.UNRESOLVED, f"patch is not a diff: {exc}", duration_s=0.0
            )
        base = GradeResult(
            task.task_id,
            Verdict.INFRA_ERROR,
            "",
            patch_sha256=ExtractedPatch(kept, files).sha256,
            patch_files=files,
            dropped_files=dropped,
        )
        attempts: list[Attempt] = []
        result = base
        for number in range(1, self.config.max_attempts + 1):
            attempt = Attempt(number, "infra_error")
            attempts.append(attempt)
            try:
                result = self._attempt(task, kept, base, attempt)
                attempt.outcome = "graded"
                break
            except (InfrastructureError, ExecError) as exc:
                attempt.error_kind, attempt.error = exc.code, str(exc)[:2000]
                probe = exc.report.to_dict() if isinstance(exc, ProbeContradiction) else None
                result = replace(
                    base,
                    reason=f"infrastructure: {exc.code}: {str(exc)[:500]}",
                    infra_kind=exc.code,
                    probe=probe or result.probe,
                    attribution=[attribution.PROBE_CONTRADICTION] if probe else [],
                )
                log.warning("grading %s attempt %d: %s", task.task_id, number, exc)
                if number < self.config.max_attempts:
                    self.sleep(self.config.retry_backoff_s * number)
            except TaskError as exc:
                attempt.error_kind, attempt.error = exc.code, str(exc)[:2000]
                result = replace(base, reason=f"task error: {exc}", infra_kind=exc.code)
                break
        result.attempts = attempts
        result.duration_s = time.monotonic() - started
        return result

    def _attempt(
        self, task: TaskSpec, patch: bytes, base: GradeResult, attempt: Attempt
    ) -> GradeResult:
        t0 = time.monotonic()
        stack = contextlib.ExitStack()
        sandbox: GradingSandbox = stack.enter_context(self.acquire(self.request_for(task)))
        try:
            attempt.sandbox_id = sandbox.id
            lease = getattr(sandbox, "lease", None)
            attempt.reused = bool(getattr(lease, "reused", False))
            attempt.durations["acquire_s"] = time.monotonic() - t0
            if attempt.reused and not self.config.allow_reuse:
                raise GradingSandboxRejected(f"sandbox {sandbox.id} is reused; config forbids it")
            return self._grade_in(sandbox, task, patch, base, attempt)
        finally:
            try:
                stack.close()
            except SandmanError as exc:  # the verdict stands; the GC reclaims the sandbox
                log.warning("release of grading sandbox %s failed: %s", attempt.sandbox_id, exc)
            attempt.durations["total_s"] = time.monotonic() - t0

    def _grade_in(
        self,
        sandbox: GradingSandbox,
        task: TaskSpec,
        patch: bytes,
        base: GradeResult,
        attempt: Attempt,
    ) -> GradeResult:
        work = private_dir(sandbox)
        try:
            return self._grade_at(sandbox, work, task, patch, base, attempt)
        finally:
            with contextlib.suppress(SandmanError):  # a lost sandbox takes its /tmp along
                sandbox.exec(f"rm -rf -- {shlex.quote(work)}", timeout=60)

    def _grade_at(  # noqa: PLR0917
        self,
        sandbox: GradingSandbox,
        work: str,
        task: TaskSpec,
        patch: bytes,
        base: GradeResult,
        attempt: Attempt,
    ) -> GradeResult:
        cfg = self.config
        timeout = self.timeout_for(task)
        t = time.monotonic()
        report: ProbeReport = run_probe(
            sandbox,
            task.conditions,
            grader_timeout_s=timeout,
            egress_host=cfg.egress_host,
            egress_timeout_s=cfg.egress_timeout_s,
            workdir=work,
        )
        attempt.durations["probe_s"] = time.monotonic() - t
        if not report.ok(refuse_unreadable=cfg.refuse_unreadable):
            if not report.contradictions:
                names = ", ".join(c.field for c in report.unreadable)
                raise GradingSandboxRejected(f"unreadable run conditions refused: {names}")
            raise ProbeContradiction(report)
        t = time.monotonic()
        agent_path, test_path = f"{work}/agent.patch", f"{work}/test.patch"
        sandbox.write_file(agent_path, patch)
        hidden = hidden_paths(sandbox, task, work, patch, base.patch_files)
        if hidden:
            attempt.durations["apply_s"] = time.monotonic() - t
            names = ", ".join(hidden[:20])
            return replace(
                base,
                probe=report.to_dict(),
                verdict=Verdict.UNRESOLVED,
                reason=f"patch touches paths its file headers do not name: {names}",
            )
        sandbox.write_file(test_path, task.test_patch)
        script = apply_script(task, agent_path, test_path, base.dropped_files)
        applied = sandbox.exec(f"( {script} )", timeout=300)
        attempt.durations["apply_s"] = time.monotonic() - t
        result = replace(base, probe=report.to_dict())
        detail = (applied.stderr or applied.stdout).strip()[-1500:]
        if applied.exit_code == 10:
            raise GradingSandboxRejected(f"grading sandbox not at a pristine base: {detail}")
        if applied.exit_code == 20:
            return replace(
                result, verdict=Verdict.UNRESOLVED, reason=f"patch does not apply: {detail}"
            )
        if applied.exit_code == 30:
            raise TaskError(f"the task's test files/test patch do not apply: {detail}")
        if applied.exit_code != 0 or "SANDMAN-APPLIED" not in applied.stdout:
            raise GradingSandboxRejected(f"apply step failed (exit {applied.exit_code}): {detail}")
        if task.harbor is not None:
            harbor.prepare_verifier(sandbox, task.harbor)  # fresh /tests and /logs/verifier
            command = harbor.verifier_command(task, task.harbor)
        else:
            command = f"cd {shlex.quote(task.repo_path)} && {task.test_command}"
        t = time.monotonic()
        run = sandbox.exec(command, timeout=timeout, max_output_bytes=cfg.max_output_bytes)
        attempt.durations["tests_s"] = time.monotonic() - t
        output = run.stdout + "\n" + run.stderr
        result = replace(
            result,
            test_exit_code=run.exit_code,
            test_timed_out=run.timed_out,
            output_tail=output[-cfg.output_tail_chars :],
            infra_kind=None,
        )
        if task.harbor is not None:
            result = harbor_verdict(result, harbor.read_rewards(sandbox), timeout)
            verdict, reason = result.verdict, result.reason
        else:
            judged = judge(
                output,
                task.fail_to_pass,
                task.pass_to_pass,
                task.test_runner,
                exit_code=run.exit_code,
                timed_out=run.timed_out,
                timeout=timeout,
            )
            result = replace(
                result,
                tests=judged.outcomes,
                fail_to_pass=judged.fail_to_pass,
                pass_to_pass=judged.pass_to_pass,
            )
            verdict, reason = judged.verdict, judged.reason
        kinds: list[str] = []
        if verdict is Verdict.UNRESOLVED:
            kinds = attribution.attribute(
                output,
                timed_out=run.timed_out,
                exit_code=run.exit_code,
                oom_kills=_oom_kills(sandbox, applied.stdout),
                egress_denied=_egress_denied(task, report),
            )
        return replace(result, verdict=verdict, reason=reason, attribution=kinds)


def harbor_verdict(result: GradeResult, rewards: dict[str, bytes], timeout: float) -> GradeResult:
    """A Harbor verifier's run -> verdict: resolved only with the full reward (1.0)."""
    score, source, metrics = harbor.parse_reward(rewards)
    info = {"reward_file": source if score is not None else None, "metrics": metrics}
    if result.test_timed_out:
        reason = f"the verifier timed out after {timeout:g}s"
        return replace(result, verdict=Verdict.UNRESOLVED, reason=reason, score=0.0, verifier=info)
    if score is None:
        return replace(result, verdict=Verdict.UNRESOLVED, reason=source, score=0.0, verifier=info)
    verdict = Verdict.RESOLVED if score >= 1.0 else Verdict.UNRESOLVED
    return replace(
        result, verdict=verdict, reason=f"{source}: reward {score:g}", score=score, verifier=info
    )


def private_dir(sandbox: GradingSandbox) -> str:
    """A fresh directory in the sandbox for this grading's files (``mktemp -d``)."""
    out = sandbox.exec(
        f'd=$(mktemp -d /tmp/sandman-grade.XXXXXXXX) && echo "{WORK_MARKER} $d"', timeout=60
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(WORK_MARKER + " ")]
    if out.exit_code != 0 or not lines:
        detail = (out.stderr or out.stdout).strip()[-500:]
        raise GradingSandboxRejected(f"cannot make a private directory: {detail}")
    return lines[-1].split(" ", 1)[1].strip()


def hidden_paths(
    sandbox: GradingSandbox, task: TaskSpec, work: str, patch: bytes, named: list[str]
) -> list[str]:
    """Paths ``git apply`` would touch that the broker's parse did not see (sorted).

    The broker decides what to drop from its own parse of the patch; this asks the
    grading sandbox's git (fresh from the image: nothing the agent ran) for its reading,
    so a patch crafted to be read one way by the filter and another by ``git apply``
    is refused instead of applied. A patch git cannot read is left to the apply step.
    """
    if not patch.strip():
        return []
    out = f"{work}/numstat"
    q = shlex.quote
    listed = sandbox.exec(
        f"cd {q(task.repo_path)} && git -c core.hooksPath=/dev/null -c safe.directory='*' "
        f"apply --numstat -z -- {q(work)}/agent.patch > {q(out)}",
        timeout=120,
    )
    if listed.exit_code != 0:
        return []
    return sorted(set(numstat_paths(sandbox.read_file(out))) - set(named))


def numstat_paths(raw: bytes) -> list[str]:
    """Paths in ``--numstat -z`` output: ``git apply`` names a rename by its new path,
    ``git diff`` by an empty field followed by the old and the new path."""
    fields = raw.split(b"\0")
    paths: list[bytes] = []
    i = 0
    while i < len(fields):
        stat = fields[i].split(b"\t", 2)
        if len(stat) == 3 and stat[2]:
            paths.append(stat[2])
        elif len(stat) == 3:  # "added\tdeleted\t" then old and new names
            paths += fields[i + 1 : i + 3]
            i += 2
        i += 1
    return [p.decode("utf-8", "surrogateescape") for p in paths]


def _counter(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(OOM_MARKER + " "):
            with contextlib.suppress(ValueError):
                return int(line.split()[1])
    return None


def _oom_kills(sandbox: GradingSandbox, before_text: str) -> int:
    """OOM kills in the sandbox's cgroup during the test run (0 when unreadable)."""
    before = _counter(before_text)
    if before is None:
        return 0
    try:
        after = _counter(sandbox.exec(OOM_KILLS, timeout=60).stdout)
    except SandmanError:
        return 0
    return max(0, (after or 0) - before)


def _egress_denied(task: TaskSpec, report: ProbeReport) -> bool:
    observed = report.observed.get("egress") or {}
    return task.conditions.egress == "denied" or observed.get("state") == "denied"
