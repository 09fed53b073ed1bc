"""execd's command line, parsed without ``argparse``.

``argparse`` (with ``gettext`` and ``textwrap``) costs every sandbox 0.4 MiB of resident
memory for a dozen ``--name value`` options read once at start. The behaviour callers
rely on is kept: ``--name value`` and ``--name=value``, typed values, ``--help``,
``--version``, and a usage error on stderr with exit status 2 for anything else.
"""

from __future__ import annotations

import sys
import types

from . import __version__

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Callable, List, NoReturn, Optional, Sequence, Tuple

    # (flag, type (None: a switch), default, help)
    Option = Tuple[str, Optional[Callable[[str], Any]], Any, str]

PROG = "python3 -m execd"
SUMMARY = "Entry point: python3 -m execd --listen HOST:PORT (or --listen-fd N)."
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(ValueError):
    """A value an option cannot take (its message is shown after ``error:``)."""


def parse_listen(value: str) -> Tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError("--listen wants HOST:PORT, got %r" % value)
    host = host.strip("[]") or "0.0.0.0"  # noqa: S104 (a pod serves on its IP)
    return host, int(port)


def _level(value: str) -> str:
    if value not in LOG_LEVELS:
        raise UsageError("invalid choice: %r (choose from %s)" % (value, ", ".join(LOG_LEVELS)))
    return value


OPTIONS: Sequence[Option] = (
    (
        "--listen",
        parse_listen,
        ("0.0.0.0", 8000),  # noqa: S104
        "HOST:PORT to serve on (default 0.0.0.0:8000; port 0 picks one)",
    ),
    (
        "--listen-fd",
        int,
        None,
        "serve on this inherited, already listening socket instead of --listen "
        "(the local backend binds it outside the sandbox's network namespace)",
    ),
    ("--workdir", str, None, "the session's starting directory"),
    (
        "--make-workdir",
        None,
        False,
        "create --workdir (and its parents) when the image lacks it: a pod's default "
        "/workspace, like the local backend's bound empty workspace",
    ),
    ("--max-body-bytes", int, 64 * 1024 * 1024, "largest request body accepted"),
    ("--log-level", _level, "INFO", "one of " + ", ".join(LOG_LEVELS)),
    ("--idle-timeout", float, 300.0, "seconds a keep-alive connection may sit idle"),
    ("--request-timeout", float, 60.0, "seconds a client may stall while sending one request"),
    (
        "--head-timeout",
        float,
        10.0,
        "seconds (in total, from connect) a connection without the token has to send "
        "its request head",
    ),
    (
        "--max-pending",
        int,
        64,
        "connections without the token held at once (the oldest is cut for a new one)",
    ),
    ("--max-runs", int, 32, "one-shot runs at once; one more is refused with 429 (never queued)"),
    (
        "--max-sessions",
        int,
        16,
        "named sessions open at once (the default session not counted)",
    ),
    (
        "--stream-keepalive",
        float,
        5.0,
        "seconds of silence after which a streamed run sends a keepalive frame",
    ),
    ("--insecure-no-auth", None, False, "serve without a token (local debugging only)"),
)


def usage() -> str:
    return "usage: %s [--help] [--version] [--OPTION VALUE ...]\n" % PROG


def _help() -> str:
    lines = [usage(), SUMMARY, "", "options:"]
    for flag, kind, default, text in OPTIONS:
        plain = isinstance(default, (int, float, str)) and not isinstance(default, bool)
        shown = " (default %s)" % (default,) if plain else ""
        lines.append("  %s%s\n      %s%s" % (flag, "" if kind is None else " VALUE", text, shown))
    return "\n".join(lines) + "\n"


def _fail(message: str) -> NoReturn:
    sys.stderr.write("%s%s: error: %s\n" % (usage(), PROG, message))
    raise SystemExit(2)


def parse_args(argv: Optional[List[str]]) -> types.SimpleNamespace:
    """The options as attributes (``--max-runs`` is ``max_runs``), defaults filled in."""
    args = list(sys.argv[1:] if argv is None else argv)
    table = {o[0]: o for o in OPTIONS}
    out = types.SimpleNamespace(**{o[0][2:].replace("-", "_"): o[2] for o in OPTIONS})
    while args:
        word = args.pop(0)
        if word in ("-h", "--help"):
            sys.stdout.write(_help())
            raise SystemExit(0)
        if word == "--version":
            sys.stdout.write(__version__ + "\n")
            raise SystemExit(0)
        flag, eq, value = word.partition("=")
        option = table.get(flag)
        if option is None:
            _fail("unrecognized arguments: %s" % word)
        kind = option[1]
        if kind is None:
            if eq:
                _fail("argument %s: ignored explicit argument %r" % (flag, value))
            setattr(out, flag[2:].replace("-", "_"), True)
            continue
        if not eq:
            if not args:
                _fail("argument %s: expected one argument" % flag)
            value = args.pop(0)
        try:
            setattr(out, flag[2:].replace("-", "_"), kind(value))
        except UsageError as exc:
            _fail("argument %s: %s" % (flag, exc))
        except ValueError:
            _fail("argument %s: invalid %s value: %r" % (flag, kind.__name__, value))
    return out
