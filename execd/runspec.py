"""What a one-shot run asks for, checked before anything starts: every bad field is a 400.

The environment is applied through the spawn itself (never an ``env`` wrapper
found on the image's PATH, which the image could replace), and the names the
broker's acquire env refuses are refused here too: they load code into every
binary (``LD_*``), replace the interpreter's modules (``PYTHON*``), run a file
before every bash (``BASH_ENV``, ``ENV``), re-split words (``IFS``), or belong
to execd itself (``SANDMAN_*``, its call marker among them).
"""

from __future__ import annotations

import os
import pwd
import re

from . import errors, files, validate
from .output import DEFAULT_MAX_OUTPUT
from .validate import MAX_TIMEOUT_S

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, List, NamedTuple, Optional

    from .validate import Doc
else:
    from .records import NamedTuple

MAX_ARGS = 65536
# The same names as broker.wire.validation (execd imports nothing from the project);
# tests/unit/execd/test_units.py keeps the two equal.
RESERVED_ENV = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "BASH_ENV",
        "ENV",
        "IFS",
    }
)
RESERVED_PREFIXES = ("SANDMAN_", "LD_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class User(NamedTuple):
    """Whom a run switches to (only when that differs from execd's own user)."""

    name: str
    uid: int
    gid: int
    groups: List[int]
    home: str


class RunSpec(NamedTuple):
    argv: List[str]
    cwd: str
    env: Dict[str, str]  # the additions to execd's starting environment
    user: Optional[User]
    stdin: Optional[bytes]  # None: /dev/null
    timeout: float
    cap: int
    binary: bool


def parse(doc: Doc, workdir: str, bash: str) -> RunSpec:
    """The run a request describes; ``bash`` runs ``cmd`` strings."""
    has_argv, has_cmd = doc.get("argv") is not None, doc.get("cmd") is not None
    if has_argv == has_cmd:
        raise errors.BadRequest("give exactly one of 'argv' and 'cmd'", "invalid_field")
    if has_cmd:
        argv = [bash, "-c", validate.string(doc, "cmd", nul_ok=False)]
    else:
        argv = _argv(doc["argv"])
    return RunSpec(
        argv=argv,
        cwd=_cwd(doc, workdir),
        env=_env(doc.get("env")),
        user=resolve_user(validate.string(doc, "user", None, nul_ok=False)),
        stdin=_stdin(doc.get("stdin_b64")),
        timeout=validate.number(doc, "timeout", MAX_TIMEOUT_S, 0.0, MAX_TIMEOUT_S),
        cap=validate.integer(doc, "max_output_bytes", DEFAULT_MAX_OUTPUT, 0, 1 << 30),
        binary=_flag(doc, "binary"),
    )


def _argv(value: object) -> List[str]:
    if not isinstance(value, list) or not value or len(value) > MAX_ARGS:
        raise errors.BadRequest("field 'argv' must be a non-empty list of strings", "invalid_field")
    for item in value:
        if not isinstance(item, str) or "\0" in item or not _encodable(item):
            raise errors.BadRequest("field 'argv' must hold strings without NUL", "invalid_field")
    return list(value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _cwd(doc: Doc, workdir: str) -> str:
    cwd = validate.string(doc, "cwd", "", nul_ok=False)
    path = os.path.normpath(os.path.join(workdir, cwd)) if cwd else workdir
    if not os.path.isdir(path):
        raise errors.BadRequest("cwd %s is not a directory" % path, "bad_cwd")
    return path


def reserved(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES)


def _env(value: object) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.BadRequest("field 'env' must be an object of strings", "invalid_field")
    for name, item in value.items():
        if not _ENV_NAME.match(name) or not isinstance(item, str):
            raise errors.BadRequest(
                "env must map names [A-Za-z_][A-Za-z0-9_]* to strings: %r" % name[:100],
                "invalid_field",
            )
        if "\0" in item or not _encodable(item):
            raise errors.BadRequest(
                "env value of %s is not text without NUL" % name, "invalid_field"
            )
        if reserved(name):
            raise errors.BadRequest(
                "env may not set %s: SANDMAN_*, LD_*, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, "
                "PYTHONINSPECT, PYTHONUSERBASE, BASH_ENV, ENV and IFS are reserved" % name,
                "reserved_env",
            )
    return dict(value)


def _stdin(value: object) -> Optional[bytes]:
    if value is None:
        return None
    if not isinstance(value, (str, memoryview)):
        raise errors.BadRequest("field 'stdin_b64' must be a string", "invalid_field")
    return b"".join(files.b64_pieces(value, "stdin_b64"))


def _flag(doc: Doc, name: str) -> bool:
    value = doc.get(name, False)
    if not isinstance(value, bool):
        raise errors.BadRequest("field %r must be a boolean" % name, "invalid_field")
    return value


def resolve_user(value: Optional[str]) -> Optional[User]:
    """The user to switch to, None when it is execd's own; typed refusals otherwise."""
    if value is None or value == "":
        return None
    try:
        entry = pwd.getpwuid(int(value)) if value.isdigit() else pwd.getpwnam(value)
    except (KeyError, OverflowError):
        raise errors.BadRequest("no user %r in the sandbox" % value[:100], "unknown_user") from None
    if entry.pw_uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        raise errors.Unprocessable(
            "execd does not run as root, so it cannot run as %r" % entry.pw_name,
            "cannot_switch_user",
        )
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)
