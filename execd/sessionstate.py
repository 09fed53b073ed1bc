"""Capture and re-apply the shell session's state: cwd, exported env, shape.

Captured with bash builtins only (no fork): ``pwd``, ``declare -px`` (parsed
here), and a digest of functions, aliases, options and traps. Restoring means
a fresh bash (pristine shape) followed by a ``cd`` and the exported variables
of the baseline, so a baseline taken after setup commands is restored too.
"""

from __future__ import annotations

from . import bashproto
from .files import sha256

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:  # shell imports the session, which must not import it back at run time
    from typing import Any, Dict, List, Optional, Tuple

    from .shell import Shell

    _Doc = Dict[str, Any]
else:
    _Doc = dict  # Dict[str, Any] without typing (a subscripted dict needs Python 3.9)

SEP = "\x1e"  # ASCII record separator: never in pwd, declare output is quoted
CAPTURE = (
    "builtin pwd; builtin printf '\\036'; declare -px; builtin printf '\\036'; "
    "{ declare -f; alias -p; shopt -p; set +o; trap -p; }"
)
IGNORED = {bashproto.CALL_VAR, "_"}


class SessionState(_Doc):
    """{"cwd": str, "env": {name: value}, "shape": digest}"""


def capture(shell: "Shell") -> Optional[SessionState]:
    status, out = shell.query(CAPTURE)
    parts = out.decode("utf-8", "surrogateescape").split(SEP)
    if status != 0 or len(parts) != 3:
        return None
    cwd, decl, shape = parts
    return SessionState(
        cwd=cwd.rstrip("\n"),
        env=parse_declare(decl),
        shape=sha256(shape.encode("utf-8", "surrogateescape")).hexdigest(),
    )


def parse_declare(text: str) -> Dict[str, str]:
    """Parse ``declare -px`` into {name: value as bash source}.

    Values are kept in bash's own quoting (``"..."`` or ``$'...'``), never
    decoded: equal source means equal value, and restoring is
    ``export NAME=<source>``, so no escaping rule can be got wrong here.
    """
    env: Dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        if not text.startswith("declare -", i):
            nl = text.find("\n", i)
            i = n if nl < 0 else nl + 1
            continue
        j = text.find(" ", i + 9) + 1
        if j <= 0:
            break
        k = j
        while k < n and text[k] not in "=\n":
            k += 1
        name = text[j:k]
        if k < n and text[k] == "=":
            end = _quoted_end(text, k + 1)
            if name not in IGNORED:
                env[name] = text[k + 1 : end]
            i = end
        else:
            i = k + 1  # declared without a value: not part of the environment
    return env


def _quoted_end(text: str, i: int) -> int:
    """Index just past the value starting at ``i`` ("...", $'...' or a bare word)."""
    n = len(text)
    if text.startswith('"', i):
        close, i = '"', i + 1
    elif text.startswith("$'", i):
        close, i = "'", i + 2
    else:
        nl = text.find("\n", i)
        return n if nl < 0 else nl
    while i < n:
        if text[i] == "\\":
            i += 2
        elif text[i] == close:
            return i + 1
        else:
            i += 1
    return n


def diff(base: SessionState, cur: Optional[SessionState]) -> List[Tuple[str, str]]:
    if cur is None:
        return [("unreadable", "session")]
    out: List[Tuple[str, str]] = []
    if base["cwd"] != cur["cwd"]:
        out.append(("cwd_changed", cur["cwd"]))
    benv, cenv = base["env"], cur["env"]
    out += [("env_added", k) for k in sorted(cenv.keys() - benv.keys())]
    out += [("env_removed", k) for k in sorted(benv.keys() - cenv.keys())]
    out += [("env_changed", k) for k in sorted(benv.keys() & cenv.keys()) if benv[k] != cenv[k]]
    if base["shape"] != cur["shape"]:
        out.append(("shell_changed", "functions, aliases, options or traps"))
    return out


def apply_script(base: SessionState, fresh: SessionState) -> str:
    """Commands turning a fresh session into the baseline's cwd and environment."""
    # cd first: it sets PWD and OLDPWD, which the baseline then overrides.
    lines = ["cd -- %s" % bashproto.quote(base["cwd"])]
    for name in sorted((fresh["env"].keys() | {"PWD", "OLDPWD"}) - base["env"].keys()):
        lines.append("unset %s" % name)
    for name, source in sorted(base["env"].items()):
        lines.append("export %s=%s" % (name, source))
    return "\n".join(lines)
