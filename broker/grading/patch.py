"""Extract the agent's patch from a rollout sandbox: its changes against the base commit.

Nothing the agent could have written is trusted. The sandbox's ``.git`` is used only as
an object store: git runs with a fresh, empty GIT_DIR in a temporary directory whose
``objects/info/alternates`` points at the repository's objects, so its HEAD, refs,
index, hooks, config, ``info/*`` and replace refs are never read. The base commit is
named by hash (and its tree checked against ``base_tree`` when the task gives one); the
worktree is staged with ``git add -A`` into a temporary index (GIT_INDEX_FILE) started
from the base tree; ``info/attributes`` of the fresh GIT_DIR (which outranks the
worktree's ``.gitattributes``) switches off eol conversion, filters and diff drivers;
``--no-textconv --no-ext-diff --binary --no-renames`` make the output exact and
byte-safe. Only test-run by-products are left out by pathspec.

The patch travels back as bytes (execd's base64 file read), and the broker drops test
paths on its own side (the rule in ``broker.grading.testrules``), so they are reported
in ``dropped``: a replaced ``git`` binary in the sandbox can lie, but it cannot smuggle
a test-file change past the broker (and the grader restores test files anyway).
"""

from __future__ import annotations

import hashlib
import shlex
import time
from dataclasses import dataclass, field

from broker.errors import PermanentError
from broker.grading.patchfmt import filter_patch, patch_paths
from broker.grading.seam import GradingSandbox
from broker.grading.spec import TaskSpec
from broker.grading.testrules import ALWAYS_DROPPED, is_test_path

GIT_OPTS = (
    "-c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.untrackedCache=false "
    "-c core.autocrlf=false -c core.safecrlf=false -c core.symlinks=true "
    "-c core.attributesFile=/dev/null -c core.excludesFile=/dev/null -c core.quotePath=true "
    "-c diff.noprefix=false -c diff.mnemonicPrefix=false -c diff.relative=false "
    "-c diff.renames=false -c diff.external= -c core.pager=cat -c 'safe.directory=*'"
)
NEUTRAL_ATTRIBUTES = "* -text -filter !diff -ident !eol !working-tree-encoding !export-subst"
MARKER = "SANDMAN-EXTRACT"


class PatchExtractionError(PermanentError):
    """The rollout sandbox's repository cannot yield a trustworthy patch.

    Not an InfrastructureError: a missing base commit in a rollout sandbox means the
    repository was destroyed or replaced inside it (``rm -rf .git``), which the grader
    cannot tell from the agent's own doing. ``reason`` is machine-readable.
    """

    code = "patch_extraction_error"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ExtractedPatch:
    patch: bytes
    files: list[str]
    dropped: list[str] = field(default_factory=list)  # removed by the broker-side check
    base_tree: str = ""
    duration_s: float = 0.0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.patch).hexdigest()

    @property
    def empty(self) -> bool:
        return not self.patch.strip()


def exclude_pathspecs(task: TaskSpec) -> list[str]:
    """Only by-products are left out in the sandbox: test paths travel to the broker, which
    drops them by the rule (``broker.grading.testrules``) and reports them as dropped."""
    return [f":(exclude,glob){g}" for g in ALWAYS_DROPPED]


def is_excluded(task: TaskSpec, path: str) -> bool:
    """The test-path rule for this task: True when an agent's change to ``path`` is dropped."""
    return is_test_path(
        path,
        test_files=task.test_files,
        test_command=task.test_command,
        exclude_paths=task.exclude_paths,
        allow_paths=task.allow_paths,
    )


def extraction_script(task: TaskSpec) -> str:
    q = shlex.quote
    excludes = " ".join(q(s) for s in exclude_pathspecs(task))
    return f"""
R={q(task.repo_path)}; B={q(task.base_commit)}; WANT_TREE={q(task.base_tree or "")}
command -v git >/dev/null 2>&1 || {{ echo "git not found" >&2; exit 5; }}
[ -e "$R/.git" ] || {{ echo "no .git in $R" >&2; exit 3; }}
if [ -f "$R/.git" ]; then
  gd=$(sed -n 's/^gitdir: //p' "$R/.git" | head -n 1)
  case "$gd" in /*) ;; *) gd="$R/$gd";; esac
else gd="$R/.git"; fi
if [ -f "$gd/commondir" ]; then
  c=$(head -n 1 "$gd/commondir"); case "$c" in /*) gd="$c";; *) gd="$gd/$c";; esac
fi
T=$(mktemp -d /tmp/sandman-extract.XXXXXX) || exit 6
G="$T/git"
g() {{ env -i PATH="$PATH" HOME="$T" LC_ALL=C GIT_CONFIG_NOSYSTEM=1 \\
  GIT_CONFIG_GLOBAL=/dev/null GIT_NO_REPLACE_OBJECTS=1 GIT_TERMINAL_PROMPT=0 \\
  GIT_DIR="$G" GIT_WORK_TREE="$R" GIT_INDEX_FILE="$T/index" git {GIT_OPTS} "$@"; }}
env -i PATH="$PATH" HOME="$T" GIT_CONFIG_NOSYSTEM=1 git init -q --bare --template= "$G" \\
  || {{ echo "git init failed" >&2; exit 6; }}
mkdir -p "$G/objects/info" "$G/info"
printf '%s\\n' "$gd/objects" > "$G/objects/info/alternates"
printf '%s\\n' {q(NEUTRAL_ATTRIBUTES)} > "$G/info/attributes"
g cat-file -e "$B^{{commit}}" 2>/dev/null || {{ echo "base commit $B not found" >&2; exit 3; }}
tree=$(g rev-parse --verify "$B^{{tree}}") || exit 6
if [ -n "$WANT_TREE" ] && [ "$tree" != "$WANT_TREE" ]; then
  echo "tree of $B is $tree, the task says $WANT_TREE" >&2; exit 4
fi
g read-tree "$B" || exit 6
g add -A -- . {excludes} || exit 6
g diff --cached --binary --full-index --no-textconv --no-ext-diff --no-color --no-renames \\
  "$B" -- > "$T/agent.patch" || exit 6
echo "{MARKER} $T $tree"
"""


def extract_patch(
    sandbox: GradingSandbox, task: TaskSpec, *, timeout: float = 300.0
) -> ExtractedPatch:
    """The agent's changes in ``sandbox`` against ``task.base_commit``, as exact bytes."""
    started = time.monotonic()
    script = extraction_script(task)
    result = sandbox.exec(f"( {script} )", timeout=timeout)
    if result.timed_out:
        raise PatchExtractionError(f"extraction timed out after {timeout}s", reason="timeout")
    reasons = {3: "base_commit_missing", 4: "base_tree_mismatch", 5: "no_git"}
    if result.exit_code != 0:
        reason = reasons.get(result.exit_code, "git_failed")
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise PatchExtractionError(f"patch extraction failed ({reason}): {detail}", reason=reason)
    marker = [ln for ln in result.stdout.splitlines() if ln.startswith(MARKER + " ")]
    if not marker:
        raise PatchExtractionError("extraction printed no result line", reason="git_failed")
    _, tmp, tree = marker[-1].split(" ", 2)
    raw = sandbox.read_file(f"{tmp}/agent.patch")
    sandbox.exec(f"rm -rf -- {shlex.quote(tmp)}", timeout=60)
    try:
        kept, dropped = filter_patch(raw, lambda p: is_excluded(task, p))
        files = patch_paths(kept)
    except ValueError as exc:
        raise PatchExtractionError(
            f"sandbox returned a malformed diff: {exc}", reason="git_failed"
        ) from exc
    return ExtractedPatch(
        patch=kept,
        files=files,
        dropped=sorted(dropped),
        base_tree=tree.strip(),
        duration_s=time.monotonic() - started,
    )
