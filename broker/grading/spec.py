"""Grading task specs: load a JSON or YAML file, validate it, resolve its patches.

The file format is published as ``broker/grading/task.schema.json``; SWE-bench instance
fields are accepted under their own names (``instance_id``, ``patch``, ``test_patch``,
``FAIL_TO_PASS``/``PASS_TO_PASS`` as JSON strings). Validation collects every problem
with its JSON path, so ``sandman task validate`` can print them all at once.

Patch fields hold an inline diff (anything with a newline) or a path relative to the
task file; they are read as bytes (binary patches stay exact).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from broker.errors import InvalidRequest
from broker.grading.patchfmt import patch_paths
from broker.grading.schema import Issue, task_schema, validate
from broker.grading.testrules import matches_any
from broker.wire.validation import parse_memory, validate_image

if TYPE_CHECKING:
    from broker.grading.harbor import HarborTask

yaml: Any = importlib.import_module("yaml")  # PyYAML (untyped)

DEFAULT_REPO_PATH = "/testbed"  # where SWE-bench images keep the repository
DEFAULT_EXCLUDES = ("**/conftest.py",)  # pytest loads these: an agent must not add them
# repo_path reaches shell scripts in the sandbox (quoted there too) and is the sandbox's
# workdir: a conservative character set means no quoting mistake anywhere can turn it into
# a command, and no NUL or line break can forge a log line. The schema carries the same
# set, but JSON Schema's ``$`` also matches before a final newline, hence fullmatch here.
_SAFE_REPO_PATH = re.compile(r"/[A-Za-z0-9._+@%=,:/-]*")


class TaskSpecError(InvalidRequest):
    """A task file that cannot be graded; ``issues`` lists every problem with its path."""

    code = "task_spec_error"

    def __init__(self, source: str, issues: list[Issue]) -> None:
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  {i}" for i in issues)
        super().__init__(f"{source}: {len(issues)} error(s)\n{lines}")


@dataclass(frozen=True)
class Conditions:
    """Declared run conditions; None means "not declared" (then not checked)."""

    timeout_s: float | None = None
    pythonhashseed: str | None = None  # "random" or a decimal seed
    memory_b: int | None = None
    cpus: float | None = None
    visible_cpus: int | None = None
    min_cpus: float | None = None  # "at least": quota (or visible CPUs if unlimited) >=
    min_memory_b: int | None = None  # "at least": cgroup limit >= (unlimited is enough)
    egress: str | None = None  # "denied" | "allowed"
    tz: str | None = None
    locale: str | None = None

    def env(self) -> dict[str, str]:
        """Environment the grading sandbox is asked for (the probe checks it took)."""
        env: dict[str, str] = {}
        if self.pythonhashseed is not None and self.pythonhashseed != "random":
            env["PYTHONHASHSEED"] = self.pythonhashseed
        if self.tz is not None:
            env["TZ"] = self.tz
        if self.locale is not None:
            env["LANG"] = env["LC_ALL"] = self.locale
        return env

    def declared(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    image: str
    base_commit: str
    test_command: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    repo_path: str = DEFAULT_REPO_PATH
    image_digest: str | None = None
    base_tree: str | None = None
    repo: str | None = None
    test_runner: str = "auto"
    test_files: tuple[str, ...] = ()
    exclude_paths: tuple[str, ...] = DEFAULT_EXCLUDES
    allow_paths: tuple[str, ...] = ()  # globs exempt from the test-path rule
    test_patch: bytes = b""
    reference_patch: bytes | None = None
    conditions: Conditions = field(default_factory=Conditions)
    source: str | None = None
    # A Harbor task directory (broker/grading/harbor.py): graded by its tests/test.sh
    # and reward file instead of test_command and per-test outcomes.
    harbor: HarborTask | None = None

    @property
    def image_ref(self) -> str:
        """The reference to acquire: pinned by digest when one is known."""
        if self.image_digest and "@" not in self.image:
            return f"{self.image}@{self.image_digest}"
        return self.image


def load_task(path: str | Path) -> TaskSpec:
    """Read and validate one task file (or Harbor task directory); TaskSpecError lists
    every problem."""
    path = Path(path)
    if path.is_dir():
        from broker.grading.harbor import load_harbor_task  # harbor imports this module

        if (path / "task.toml").is_file():
            return load_harbor_task(path)
        raise TaskSpecError(str(path), [Issue("$", "a directory without task.toml")])
    try:
        doc = load_document(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise TaskSpecError(str(path), [Issue("$", f"cannot read: {exc}")]) from exc
    return parse_task(doc, base_dir=path.parent, source=str(path))


def load_document(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        return yaml.safe_load(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc


def check_task_file(path: str | Path) -> list[Issue]:
    """Every problem in a task file (empty when it is valid)."""
    try:
        load_task(path)
    except TaskSpecError as exc:
        return exc.issues
    return []


def parse_task(doc: Any, *, base_dir: Path | None = None, source: str = "<task>") -> TaskSpec:
    issues = validate(doc, task_schema())
    if not isinstance(doc, dict):
        raise TaskSpecError(source, issues)
    p = _Parser(doc, base_dir, issues)
    spec = p.build(source)
    if issues:
        raise TaskSpecError(source, issues)
    assert spec is not None
    return spec


class _Parser:
    def __init__(self, doc: dict[str, Any], base_dir: Path | None, issues: list[Issue]) -> None:
        self.doc = doc
        self.base_dir = base_dir
        self.issues = issues

    def err(self, path: str, message: str) -> None:
        self.issues.append(Issue(path, message))

    def build(self, source: str) -> TaskSpec | None:
        d = self.doc
        task_id = d.get("task_id") or d.get("instance_id")
        if "task_id" in d and "instance_id" in d and d["task_id"] != d["instance_id"]:
            self.err("$.instance_id", "differs from task_id; give one of them")
        if not task_id:
            self.err("$.task_id", "is required (or its SWE-bench name instance_id)")
        image, digest = self.image()
        f2p = self.test_list("FAIL_TO_PASS")
        p2p = self.test_list("PASS_TO_PASS")
        f2p_flagged = any(i.path == "$.FAIL_TO_PASS" for i in self.issues)
        if "FAIL_TO_PASS" in d and not f2p and not f2p_flagged:
            self.err("$.FAIL_TO_PASS", "is empty: a task must name the tests the fix makes pass")
        for name in sorted(set(f2p) & set(p2p)):
            self.err("$.PASS_TO_PASS", f"{name!r} is also in FAIL_TO_PASS")
        if "patch" in d and "reference_patch" in d:
            self.err("$.patch", "give either patch (SWE-bench) or reference_patch, not both")
        test_patch = self.patch("test_patch") or b""
        ref_key = "reference_patch" if "reference_patch" in d else "patch"
        reference = self.patch(ref_key)
        test_files = self.test_files(test_patch)
        allow_paths = self.allow_paths(test_files)
        repo_path = self.repo_path()
        conditions = self.conditions()
        if self.issues:
            return None
        return TaskSpec(
            task_id=str(task_id),
            image=image,
            image_digest=digest,
            base_commit=d["base_commit"],
            base_tree=d.get("base_tree"),
            repo=d.get("repo"),
            repo_path=repo_path,
            test_command=d["test_command"],
            test_runner=d.get("test_runner", "auto"),
            fail_to_pass=tuple(f2p),
            pass_to_pass=tuple(p2p),
            test_files=tuple(test_files),
            exclude_paths=tuple(d.get("exclude_paths", DEFAULT_EXCLUDES)),
            allow_paths=tuple(allow_paths),
            test_patch=test_patch,
            reference_patch=reference,
            conditions=conditions,
            source=source,
        )

    def repo_path(self) -> str:
        """Absolute, normalised and from the safe set (see ``_SAFE_REPO_PATH``)."""
        value = self.doc.get("repo_path", DEFAULT_REPO_PATH)
        if not isinstance(value, str) or any(i.path == "$.repo_path" for i in self.issues):
            return DEFAULT_REPO_PATH  # the schema already said what is wrong
        if not _SAFE_REPO_PATH.fullmatch(value):
            self.err(
                "$.repo_path",
                f"{value[:80]!r} must be an absolute path of letters, digits and ._+@%=,:/- "
                "(no spaces, quotes, shell metacharacters, NUL or line breaks)",
            )
        elif {".", ".."} & set(value.split("/")):
            self.err("$.repo_path", f"{value[:80]!r} must be normalised (no . or .. parts)")
        return str(PurePosixPath(value))

    def image(self) -> tuple[str, str | None]:
        image = self.doc.get("image")
        digest = self.doc.get("image_digest")
        if not isinstance(image, str):
            return "", None
        try:
            validate_image(image)
        except InvalidRequest as exc:
            self.err("$.image", str(exc))
        if "@" in image:
            pinned = image.split("@", 1)[1]
            if digest and digest != pinned:
                self.err("$.image_digest", f"{digest} contradicts the digest in image")
            digest = pinned
        return image, digest

    def test_list(self, key: str) -> list[str]:
        raw = self.doc.get(key, [])
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                self.err(f"$.{key}", f"is a string but not a JSON list: {exc.msg}")
                return []
            if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
                self.err(f"$.{key}", "JSON string must hold a list of non-empty strings")
                return []
        if not isinstance(raw, list):
            return []
        out = [x for x in raw if isinstance(x, str)]
        dupes = sorted({x for x in out if out.count(x) > 1})
        if dupes:
            self.err(f"$.{key}", f"duplicate test names: {dupes}")
        return out

    def patch(self, key: str) -> bytes | None:
        value = self.doc.get(key)
        if not isinstance(value, str):
            return None
        if "\n" in value or not value.strip():
            return value.encode()
        if self.base_dir is None:
            self.err(f"$.{key}", "a patch file path needs a task file to be relative to")
            return None
        path = self.base_dir / value
        try:
            return path.read_bytes()
        except OSError as exc:
            self.err(f"$.{key}", f"cannot read patch file {value!r}: {exc.strerror}")
            return None

    def test_files(self, test_patch: bytes) -> list[str]:
        declared = self.doc.get("test_files")
        files = list(declared) if isinstance(declared, list) else []
        try:
            from_patch = patch_paths(test_patch)
        except ValueError as exc:
            self.err("$.test_patch", f"not a git diff: {exc}")
            from_patch = []
        for name in from_patch:
            if name not in files:
                files.append(name)
        if declared is None and not test_patch:
            self.err("$.test_files", "declare test_files or a test_patch (tests must be known)")
        for i, name in enumerate(files):
            if not isinstance(name, str) or any(c in name for c in "\x00\r\n"):
                self.err(f"$.test_files[{i}]", f"{name!r} must be a path without NUL or newline")
                continue
            parts = PurePosixPath(name).parts
            if ".." in parts or name.startswith("/"):
                self.err(f"$.test_files[{i}]", f"{name!r} must be a relative path inside the repo")
            elif parts and parts[0] == ".git":
                self.err(f"$.test_files[{i}]", "paths under .git are not test files")
        return files

    def allow_paths(self, test_files: list[str]) -> list[str]:
        """Globs exempt from the test-path rule; never a declared test file or .git."""
        raw = self.doc.get("allow_paths")
        if not isinstance(raw, list):
            return []
        globs = [g for g in raw if isinstance(g, str) and g]
        for i, glob in enumerate(globs):
            where = f"$.allow_paths[{i}]"
            parts = PurePosixPath(glob).parts
            if glob.startswith("/") or ".." in parts:
                self.err(where, f"{glob!r} must be a relative glob inside the repo")
            elif parts and parts[0] == ".git":
                self.err(where, "paths under .git are never taken from an agent")
            for name in test_files:
                if isinstance(name, str) and matches_any(name, [glob]):
                    self.err(where, f"{glob!r} matches test file {name!r}: the task's tests win")
        return globs

    def memory(self, raw: dict[str, Any], key: str) -> int | None:
        value = raw.get(key)
        if not isinstance(value, str | int) or isinstance(value, bool):
            return None
        try:
            return parse_memory(value)
        except InvalidRequest as exc:
            self.err(f"$.conditions.{key}", str(exc))
            return None

    def conditions(self) -> Conditions:
        raw = self.doc.get("conditions") or {}
        if not isinstance(raw, dict):
            return Conditions()
        memory_b = self.memory(raw, "memory")
        min_memory_b = self.memory(raw, "min_memory")
        for exact, least in (("cpus", "min_cpus"), ("memory", "min_memory")):
            if exact in raw and least in raw:
                self.err(f"$.conditions.{least}", f"give either {exact} (exact) or {least}")
        seed = raw.get("pythonhashseed")
        if isinstance(seed, str) and re.fullmatch(r"\d+", seed) and int(seed) > 4294967295:
            self.err("$.conditions.pythonhashseed", "must be <= 4294967295")
        timeout = raw.get("timeout_s")
        cpus = raw.get("cpus")
        min_cpus = raw.get("min_cpus")
        return Conditions(
            timeout_s=float(timeout) if isinstance(timeout, int | float) else None,
            pythonhashseed=None if seed is None else str(seed),
            memory_b=memory_b,
            cpus=float(cpus) if isinstance(cpus, int | float) else None,
            visible_cpus=raw.get("visible_cpus"),
            min_cpus=float(min_cpus) if isinstance(min_cpus, int | float) else None,
            min_memory_b=min_memory_b,
            egress=raw.get("egress"),
            tz=raw.get("tz"),
            locale=raw.get("locale"),
        )
