"""Harbor task directories: load them as ``TaskSpec``s and verify the way Harbor does.

A Harbor task is a directory: ``task.toml`` (``[metadata]``, ``[verifier]`` with
``timeout_sec``/``env``/``user``, ``[agent]``, ``[environment]`` with ``docker_image``,
``cpus``, ``memory_mb``...), ``instruction.md``, ``environment/`` (a Dockerfile),
``tests/test.sh`` (the verifier: it writes ``/logs/verifier/reward.txt`` or
``reward.json``) and ``solution/solve.sh`` (the oracle).

Sandman grades only tasks with a prebuilt image (``[environment] docker_image``): it
builds nothing. The agent's changes travel as a git diff against a base commit, like
SWE tasks, so ``[metadata.sandman]`` names the repository in the image (``repo_path``,
default ``/app``, Harbor's usual workdir) and its ``base_commit``; optional
``allow_paths``, ``exclude_paths`` and ``conditions`` mean what they mean in a task file.

Grading follows Harbor's separate-verifier mode: a fresh sandbox from the image, the
agent patch applied (the test-path rule drops test files from it), ``tests/`` staged
fresh at ``/tests`` (never present during the rollout), a fresh empty
``/logs/verifier`` made right before ``test.sh`` runs with the verifier's timeout, user
and env, and the reward read from that directory afterwards.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shlex
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from broker.errors import InfrastructureError, PermanentError, TemporaryError
from broker.grading.schema import Issue
from broker.grading.seam import GradingSandbox
from broker.grading.spec import TaskSpec, TaskSpecError, parse_task

DEFAULT_REPO_PATH = "/app"  # Harbor images' usual WORKDIR
DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # Harbor's default [verifier] timeout_sec
TESTS_DIR, SOLUTION_DIR, LOGS_DIR = "/tests", "/solution", "/logs/verifier"
MAX_DIR_BYTES = 32 << 20  # tests/ or solution/ are sent through execd
REWARD_FILES = ("reward.txt", "reward.json")  # read in this order; the first present wins
REWARD_MARKER = "SANDMAN-REWARD"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
# Where the generated task file's fields come from, for messages in task.toml's terms.
_WHERE = {
    "$.task_id": "task.toml [task] name",
    "$.image": "task.toml [environment] docker_image",
    "$.base_commit": "task.toml [metadata.sandman] base_commit",
    "$.base_tree": "task.toml [metadata.sandman] base_tree",
    "$.repo_path": "task.toml [metadata.sandman] repo_path",
    "$.allow_paths": "task.toml [metadata.sandman] allow_paths",
    "$.exclude_paths": "task.toml [metadata.sandman] exclude_paths",
    "$.conditions": "task.toml [metadata.sandman.conditions]",
}


class VerifierUserUnavailable(InfrastructureError, PermanentError):
    """The sandbox cannot run the verifier as ``[verifier] user`` (no such user, or no
    right to switch to it): running it as root instead would change what it checks."""

    code = "verifier_user_unavailable"


class VerifierSetupFailed(InfrastructureError, TemporaryError):
    """``/tests`` or ``/logs/verifier`` could not be made fresh in the grading sandbox."""

    code = "verifier_setup_failed"


@dataclass(frozen=True)
class HarborTask:
    root: str
    instruction: str
    tests: tuple[tuple[str, bytes, int], ...]  # (relative path, content, mode)
    solution: tuple[tuple[str, bytes, int], ...]  # empty: no oracle
    verifier_env: tuple[tuple[str, str], ...] = ()
    verifier_user: str | None = None
    solution_env: tuple[tuple[str, str], ...] = ()
    agent_timeout_s: float | None = None


def is_harbor_dir(path: Path) -> bool:
    return path.is_dir() and (path / "task.toml").is_file()


def load_harbor_task(root: Path) -> TaskSpec:
    """Read and validate a Harbor task directory; TaskSpecError lists every problem."""
    issues: list[Issue] = []
    try:
        config = tomllib.loads((root / "task.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TaskSpecError(str(root), [Issue("task.toml", f"cannot read: {exc}")]) from exc
    loader = _Loader(root, config, issues)
    doc = loader.task_document()
    harbor = loader.harbor()
    try:
        spec = parse_task(doc, base_dir=root, source=str(root)) if doc is not None else None
    except TaskSpecError as exc:
        issues += [Issue(_where(i.path), i.message) for i in exc.issues]
        spec = None
    if issues or spec is None or harbor is None:
        raise TaskSpecError(str(root), issues)
    return replace(spec, harbor=harbor)


def _where(path: str) -> str:
    for prefix, where in _WHERE.items():
        if path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "["):
            return where + path[len(prefix) :]
    return path


def _section(config: dict[str, Any], name: str, issues: list[Issue]) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        issues.append(Issue(f"task.toml [{name}]", "must be a table"))
        return {}
    return value


class _Loader:
    def __init__(self, root: Path, config: dict[str, Any], issues: list[Issue]) -> None:
        self.root, self.config, self.issues = root, config, issues
        self.environment = _section(config, "environment", issues)
        self.verifier = _section(config, "verifier", issues)
        self.agent = _section(config, "agent", issues)
        metadata = _section(config, "metadata", issues)
        sandman = metadata.get("sandman", {})
        if not isinstance(sandman, dict):
            issues.append(Issue("task.toml [metadata.sandman]", "must be a table"))
            sandman = {}
        self.sandman: dict[str, Any] = sandman

    def err(self, where: str, message: str) -> None:
        self.issues.append(Issue(where, message))

    def task_document(self) -> dict[str, Any] | None:
        """The equivalent Sandman task file, validated by ``parse_task``."""
        image = self.environment.get("docker_image")
        if not image:
            built = (self.root / "environment" / "Dockerfile").is_file()
            what = "has only environment/Dockerfile" if built else "names no image"
            self.err(
                "task.toml [environment] docker_image",
                f"is required: the task {what}; Sandman builds no images. Build and push "
                "the image, then set [environment] docker_image to its reference "
                "(a digest reference name@sha256:... is best)",
            )
            return None
        if "base_commit" not in self.sandman:
            self.err(
                "task.toml [metadata.sandman] base_commit",
                "is required: the commit the image's repository (repo_path, default "
                f"{DEFAULT_REPO_PATH}) is at; the agent's changes travel to the verifier as "
                "a git diff against it",
            )
            return None
        gpus = self.environment.get("gpus", 0)
        if gpus:
            self.err("task.toml [environment] gpus", f"is {gpus!r}: Sandman has no GPU sandboxes")
        if "environment" in self.verifier:
            self.err(
                "task.toml [verifier.environment]",
                "a separate verifier image is not supported: the verifier runs in a fresh "
                "sandbox of [environment] docker_image",
            )
        repo_path = self.sandman.get("repo_path", DEFAULT_REPO_PATH)
        for staged in (TESTS_DIR, SOLUTION_DIR, "/logs"):
            if isinstance(repo_path, str) and (repo_path + "/").startswith(staged + "/"):
                self.err(
                    "task.toml [metadata.sandman] repo_path",
                    f"{repo_path!r} is inside {staged}, which the grader makes anew",
                )
        package = self.config.get("task") or {}
        name = package.get("name") if isinstance(package, dict) else None
        doc: dict[str, Any] = {
            "task_id": name or self.root.name,
            "image": image,
            "repo_path": repo_path,
            "test_command": f"bash {TESTS_DIR}/test.sh",
            "FAIL_TO_PASS": [f"{TESTS_DIR}/test.sh"],  # the verifier is the one test
            "test_files": [],
            "conditions": self.conditions(),
        }
        for key in ("base_commit", "base_tree", "allow_paths", "exclude_paths"):
            if key in self.sandman:
                doc[key] = self.sandman[key]
        extra = sorted(
            set(self.sandman)
            - {
                "base_commit",
                "base_tree",
                "allow_paths",
                "exclude_paths",
                "repo_path",
                "conditions",
            }
        )
        for key in extra:
            self.err(f"task.toml [metadata.sandman] {key}", "unknown field")
        return doc

    def conditions(self) -> dict[str, Any]:
        declared = dict(self.sandman.get("conditions") or {})
        timeout = self.verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)
        declared.setdefault("timeout_s", timeout)
        if "cpus" in self.environment and "cpus" not in declared:
            declared.setdefault("min_cpus", self.environment["cpus"])
        memory_mb = self.environment.get("memory_mb")
        if isinstance(memory_mb, int) and "memory" not in declared:
            declared.setdefault("min_memory", f"{memory_mb}Mi")
        mode = self.verifier.get("network_mode") or self.environment.get("network_mode")
        if mode == "no-network" or self.environment.get("allow_internet") is False:
            declared.setdefault("egress", "denied")
        elif mode == "public":
            declared.setdefault("egress", "allowed")
        return declared

    def harbor(self) -> HarborTask | None:
        instruction = self.root / "instruction.md"
        if not instruction.is_file():
            self.err("instruction.md", "is required (the task's instruction)")
        tests = self.files("tests")
        if tests is not None and not any(rel == "test.sh" for rel, _, _ in tests):
            self.err("tests/test.sh", "is required (the verifier Harbor runs)")
        solution = self.files("solution") or ()
        if solution and not any(rel == "solve.sh" for rel, _, _ in solution):
            self.err("solution/solve.sh", "is required when solution/ exists (the oracle)")
        user = self.verifier.get("user")
        if user is not None:
            user = str(user)
            if not (user.isdigit() or _USER.fullmatch(user)):
                self.err("task.toml [verifier] user", f"{user!r} is not a user name or uid")
        timeout = self.agent.get("timeout_sec")
        verifier_env = self.env("verifier", self.verifier)
        solution_env = self.env("solution", _section(self.config, "solution", self.issues))
        if self.issues or tests is None:
            return None
        return HarborTask(
            root=str(self.root),
            instruction=instruction.read_text(encoding="utf-8"),
            tests=tests,
            solution=solution,
            verifier_env=verifier_env,
            verifier_user=user,
            solution_env=solution_env,
            agent_timeout_s=float(timeout) if isinstance(timeout, int | float) else None,
        )

    def env(self, section: str, table: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        raw = table.get("env") or {}
        if not isinstance(raw, dict):
            self.err(f"task.toml [{section}] env", "must be a table of strings")
            return ()
        out: list[tuple[str, str]] = []
        for key, value in sorted(raw.items()):
            where = f"task.toml [{section}.env] {key}"
            if not _ENV_NAME.fullmatch(key) or key.startswith("SANDMAN_"):
                self.err(where, "is not a valid variable name (SANDMAN_* is reserved)")
            elif not isinstance(value, str):
                self.err(where, "must be a string")
            elif "${" in value:
                self.err(where, "host variable templates (${...}) are not resolved: give the value")
            else:
                out.append((key, value))
        return tuple(out)

    def files(self, name: str) -> tuple[tuple[str, bytes, int], ...] | None:
        top = self.root / name
        if not top.is_dir():
            if name == "tests":
                self.err("tests/test.sh", "is required (the verifier Harbor runs)")
            return None
        out: list[tuple[str, bytes, int]] = []
        total = 0
        for path in sorted(top.rglob("*")):
            rel = path.relative_to(top).as_posix()
            if path.is_symlink():
                self.err(f"{name}/{rel}", "is a symlink: give a regular file")
            elif path.is_file():
                data = path.read_bytes()
                total += len(data)
                out.append((rel, data, 0o755 if path.stat().st_mode & 0o111 else 0o644))
        if total > MAX_DIR_BYTES:
            self.err(f"{name}/", f"holds {total} bytes; at most {MAX_DIR_BYTES}")
        return tuple(out)


# -- in the sandbox -------------------------------------------------------------------


def stage(sandbox: GradingSandbox, target: str, files: tuple[tuple[str, bytes, int], ...]) -> None:
    """``target`` made anew (whatever the image or a patch left there is gone), then filled."""
    q = shlex.quote(target)
    out = sandbox.exec(f"rm -rf -- {q} && mkdir -m 0755 -- {q}", timeout=60)
    if out.exit_code != 0:
        raise VerifierSetupFailed(f"cannot stage {target}: {(out.stderr or out.stdout)[-500:]}")
    for rel, data, mode in files:
        sandbox.write_file(f"{target}/{rel}", data, mode=mode)


def fresh_logs_script(user: str | None) -> str:
    """Make ``/logs/verifier`` new and empty, owned by the verifier's user (private)."""
    switch = ""
    if user not in (None, "root", "0"):
        u = shlex.quote(str(user))
        switch = f"chown -- {u} {LOGS_DIR} || exit 42\nrunuser -u {u} -- true || exit 42\n"
    return (
        f"rm -rf -- {LOGS_DIR} || exit 41\n"
        "mkdir -p /logs || exit 41\n"
        f"mkdir -m 0700 -- {LOGS_DIR} || exit 41\n"
        f'[ -z "$(ls -A {LOGS_DIR})" ] || exit 41\n'
        f"{switch}echo SANDMAN-LOGS-READY\n"
    )


def verifier_command(task: TaskSpec, harbor: HarborTask) -> str:
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in harbor.verifier_env)
    run = f"env {env} bash {TESTS_DIR}/test.sh" if env else f"bash {TESTS_DIR}/test.sh"
    user = harbor.verifier_user
    if user not in (None, "root", "0"):
        run = f"runuser -u {shlex.quote(str(user))} -- {run}"
    return f"cd {shlex.quote(task.repo_path)} && {run}"


def prepare_verifier(sandbox: GradingSandbox, harbor: HarborTask) -> None:
    stage(sandbox, TESTS_DIR, harbor.tests)
    out = sandbox.exec(f"( {fresh_logs_script(harbor.verifier_user)} )", timeout=60)
    if out.exit_code == 42:
        raise VerifierUserUnavailable(
            f"cannot run the verifier as {harbor.verifier_user!r} in this sandbox: "
            f"{(out.stderr or out.stdout).strip()[-500:]}"
        )
    if out.exit_code != 0 or "SANDMAN-LOGS-READY" not in out.stdout:
        raise VerifierSetupFailed(f"cannot make {LOGS_DIR}: {(out.stderr or out.stdout)[-500:]}")


def read_rewards(sandbox: GradingSandbox) -> dict[str, bytes]:
    """The reward files the verifier wrote (regular files only, first 64 KiB)."""
    names = " ".join(REWARD_FILES)
    out = sandbox.exec(
        f"for f in {names}; do p={LOGS_DIR}/$f; "
        f'if [ -f "$p" ] && [ ! -L "$p" ]; then printf "{REWARD_MARKER} %s " "$f"; '
        'head -c 65536 "$p" | base64 -w0; echo; fi; done',
        timeout=60,
    )
    found: dict[str, bytes] = {}
    for line in out.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == REWARD_MARKER and parts[1] in REWARD_FILES:
            found[parts[1]] = base64.b64decode(parts[2])
        elif len(parts) == 2 and parts[0] == REWARD_MARKER and parts[1] in REWARD_FILES:
            found[parts[1]] = b""
    return found


def parse_reward(files: dict[str, bytes]) -> tuple[float | None, str, dict[str, Any]]:
    """(reward or None, where it came from or why there is none, every metric read).

    ``reward.txt`` holds one number; ``reward.json`` an object whose ``reward`` key (or
    single numeric value) is the reward. A reward must be a finite number."""
    for name in REWARD_FILES:
        if name not in files:
            continue
        text = files[name].decode("utf-8", "replace").strip()
        try:
            if name == "reward.txt":
                value: Any = float(text)
                metrics: dict[str, Any] = {"reward": value}
            else:
                metrics = json.loads(text)
                if not isinstance(metrics, dict):
                    return None, f"{name} is not a JSON object", {}
                numbers = {k: v for k, v in metrics.items() if _number(v)}
                value = metrics.get(
                    "reward", next(iter(numbers.values())) if len(numbers) == 1 else None
                )
        except ValueError:
            return None, f"{name} is not a number: {text[:80]!r}", {}
        if not _number(value) or not math.isfinite(float(value)):
            return None, f"{name} holds no finite reward: {text[:80]!r}", {}
        return float(value), name, metrics
    return None, f"the verifier wrote no {' or '.join(REWARD_FILES)} in {LOGS_DIR}", {}


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def solution_script(task: TaskSpec, harbor: HarborTask) -> str:
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in harbor.solution_env)
    run = f"env {env} bash {SOLUTION_DIR}/solve.sh" if env else f"bash {SOLUTION_DIR}/solve.sh"
    return f"cd {shlex.quote(task.repo_path)} && {run}"
