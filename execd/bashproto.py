"""The text execd feeds the persistent bash, and how values are quoted for it.

Why this shape (see docs/execd.md, "Persistence versus killable timeouts"):

* The user's command is written to a file and ``source``d at the top level of
  the session, so ``cd``, ``export``, ``declare``, functions, aliases, options
  and background jobs all live in the one long-lived shell.
* ``source`` gets its own redirections: stdin from /dev/null (commands see EOF,
  never hang), stdout/stderr to the session pipes, the protocol fds closed.
  Bash undoes a builtin's redirections when it returns, so ``exec >/dev/null``
  or ``exec 2>&-`` inside a command cannot break the next call.
* Completion is signalled out of band: bash prints "<id> <status>" on a
  dedicated fd. Stdout is never parsed for markers.
* A timeout sends SIGUSR1 to bash, whose trap ``return``s out of the sourced
  file (and, re-sent, out of any user function it is in), after the command's
  processes were killed; the shell survives with its state.
* Every process a call starts inherits ``SANDMAN_EXECD_CALL=<id>`` so the
  processes of a timed-out call can be told from earlier background jobs even
  after they left the shell's process tree.
"""

import itertools
import re

OUT_FD = 251
ERR_FD = 252
CTL_FD = 253
CALL_VAR = "SANDMAN_EXECD_CALL"
_CALL_IDS = itertools.count(1)


def next_call_id() -> int:
    """A call id unique across every session and run of this execd (``next`` on a
    count is atomic under the GIL): a timeout kills the carriers of its own id only."""
    return next(_CALL_IDS)


_UNSAFE = re.compile(rb"[^A-Za-z0-9_./,:=@%+-]")
_ESCAPE = re.compile(rb"[^ -&(-\[\]-~]")  # inside $'...': all but printable, ' and \


def quote(value: str) -> str:
    """Quote for bash as $'...': every byte survives, whatever the locale."""
    raw = value.encode("utf-8", "surrogateescape")
    if raw and not _UNSAFE.search(raw):
        return raw.decode("ascii")
    return "$'" + _ESCAPE.sub(lambda m: b"\\x%02x" % m.group()[0], raw).decode("ascii") + "'"


def _call_body(script_path: str) -> str:
    """The per-call text; ``builtin`` everywhere so user functions named
    ``source``, ``export`` or ``set`` cannot hijack the protocol."""
    return (
        "__execd_busy=1; builtin export {var}=$__execd_i; "
        "builtin source {path} </dev/null >&{out} 2>&{err} {out}>&- {err}>&- {ctl}>&-; "
        "__execd_s=$?; __execd_busy=; "
        'builtin printf "$__execd_i %s\\n" "$__execd_s" >&{ctl}; '
        "builtin unset {var}; builtin set +e; builtin shopt -s expand_aliases; "
        "[[ -n ${{__execd_abort-}} ]] && "
        "{{ builtin trap - DEBUG; builtin set +T; __execd_abort=; }}; "
        'builtin alias __execd="$__execd_alias"'
    ).format(var=CALL_VAR, path=quote(script_path), out=OUT_FD, err=ERR_FD, ctl=CTL_FD)


def init_script(workdir: str, script_path: str) -> bytes:
    """Run once per session, before the first call.

    Bash reads a pipe one byte per system call, so the per-call line is kept
    tiny: an alias holds the call body (parsed from memory, not from the pipe)
    and re-defines itself after each call in case the command removed it.
    """
    lines = [
        "shopt -s expand_aliases",
        # On abort: return now, and (DEBUG trap with functrace) before every
        # further command, until the sourced file and all functions are left.
        "__execd_dbg='[[ -n ${__execd_abort-} && -n ${__execd_busy-} ]] && return 124'",
        'function __execd_arm { __execd_abort=1; set -T; trap "$__execd_dbg" DEBUG; }',
        "trap '[[ -n ${__execd_busy-} ]] && { __execd_arm; return 124; }' USR1",
        "readonly __execd_alias=%s" % quote(_call_body(script_path)),
        'alias __execd="$__execd_alias"',
        "cd -- %s || builtin printf 'execd: cannot cd to %%s\\n' %s >&%d"
        % (quote(workdir), quote(workdir), ERR_FD),
        "builtin printf '0 0\\n' >&%d" % CTL_FD,
    ]
    return ("\n".join(lines) + "\n").encode()


def call_line(call_id: int) -> bytes:
    """One short line per call; bash has read all of it before the command runs."""
    return b"__execd_i=%d;__execd\n" % call_id
