"""Local sandboxes found by the kernel's process list: the local analogue of pod labels.

A pod carries its installation and nonce as labels the API server keeps for as long as
the pod exists, whoever created it and whatever became of its creator. A local sandbox
gets the same from its own command line: bubblewrap is started with

    --setenv SANDMAN_SANDBOX <state>/local-pods/<installation>/<namespace>/<name>/<nonce>
    --unsetenv SANDMAN_SANDBOX

(set and at once unset, so the variable reaches no process in the sandbox: only the
argv carries it). The marker is fixed before the process starts, from values the ledger
committed before the create, and it lives exactly as long as the process: a worker
killed one instruction after ``fork`` still leaves a sandbox that ``scan`` finds, with
the nonce the GC needs to decide whether it is ours. Both bubblewrap processes of a
sandbox carry it (the outer one and its PID-namespace init, a fork of it); killing them
kills everything in the sandbox. A zombie has no command line, so a dead sandbox that its
parent has not reaped yet is, correctly, not found.

A sandbox's helper (its slirp4netns uplink, ``broker.backends.localnet``) takes options
of its own, so it carries the marker as its argv[0] instead (``SANDMAN_SANDBOX=<mark>``,
``helper_argv0``): found, listed and killed with its sandbox by the same scan.

The marker holds nothing secret (a nonce is a pod label on Kubernetes too); a process in
the sandbox can read it from ``/proc/1/cmdline``, as it can read its hostname.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from broker.errors import KubeInvalid

MARK_ENV = "SANDMAN_SANDBOX"
_SETENV = (b"--setenv", MARK_ENV.encode())
_ARGV0 = MARK_ENV.encode() + b"="


@dataclass(frozen=True)
class SandboxProcess:
    """One marked process: a sandbox's bubblewrap, its PID-namespace init, or a helper."""

    pid: int
    installation: str
    namespace: str
    name: str
    nonce: str


def marker(root: Path, installation: str, namespace: str, name: str, nonce: str) -> str:
    """The marker of one sandbox under ``root`` (``<state>/local-pods``, resolved).

    Each part becomes one path segment, so none may hold a slash or a NUL (a pod name,
    a namespace, a nonce never do; an installation id could be configured so)."""
    parts = (installation, namespace, name, nonce)
    for part in parts:
        if not part or "/" in part or "\0" in part or part in (".", ".."):
            raise KubeInvalid(f"cannot mark a local sandbox with {part!r}: not one path segment")
    return "/".join((str(root), *parts))


def marker_args(mark: str) -> list[str]:
    """The bubblewrap options that put ``mark`` on the command line and nowhere else."""
    return ["--setenv", MARK_ENV, mark, "--unsetenv", MARK_ENV]


def helper_argv0(mark: str) -> str:
    """The argv[0] that marks a sandbox's helper process as the sandbox's."""
    return MARK_ENV + "=" + mark


def _first_mark(args: list[bytes]) -> bytes | None:
    """A helper's argv[0] marker, else the value of the FIRST ``--setenv SANDMAN_SANDBOX``:
    the backend puts its marker first, so no later option (a request's env) can pose as
    another sandbox."""
    if args and args[0].startswith(_ARGV0):
        return args[0][len(_ARGV0) :]
    for i in range(len(args) - 2):
        if (args[i], args[i + 1]) == _SETENV:
            return args[i + 2]
    return None


def _parse(pid: int, args: list[bytes], prefix: bytes) -> SandboxProcess | None:
    mark = _first_mark(args)
    if mark is None or not mark.startswith(prefix):
        return None
    parts = os.fsdecode(mark[len(prefix) :]).split("/")
    if len(parts) == 4 and all(parts):
        return SandboxProcess(pid, *parts)
    return None


def scan(root: Path) -> list[SandboxProcess]:
    """Every live process marked as a sandbox under ``root``: one pass over /proc."""
    prefix = os.fsencode(str(root)) + b"/"
    needles = (MARK_ENV.encode() + b"\0" + prefix, _ARGV0 + prefix)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if not any(needle in raw for needle in needles):
            continue
        found = _parse(int(entry), raw.split(b"\0"), prefix)
        if found is not None:
            out.append(found)
    return out


def is_marked(pid: int, mark: str) -> bool:
    """Whether ``pid`` is (still) a process of the sandbox ``mark``: the cheap check for a
    pid a creator recorded, immune to PID reuse (a new process has another argv)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _first_mark(raw.split(b"\0")) == os.fsencode(mark)


def kill(procs: Iterable[SandboxProcess]) -> None:
    """SIGKILL each process and the process group it leads (the outer bubblewrap leads
    its own session); the PID-namespace init's death takes everything inside with it."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)
