"""execd's private runtime directory, and the sweeping of ones left by dead daemons.

A daemon killed with SIGKILL cannot remove its directory. In a pod that dies
with the pod, but on a developer machine many local sandboxes share /dev/shm,
so each directory records its owner (pid, process start time, pid namespace)
and a starting daemon removes the directories of owners that are gone. Owners
in another pid namespace are never judged: their processes are invisible here.
"""

from __future__ import annotations

import os

from . import proc

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Optional

OWNER = "owner"


def _identity(pid: int) -> Optional[str]:
    info = proc.read_stat(pid)
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return None if info is None else "%d %d %s" % (pid, info.start, ns)


def create() -> str:
    """A private 0700 dir for the command file, never next to execd itself.

    tmpfs is preferred: the command file is rewritten before every call, and
    on a disk-backed overlay /tmp that costs milliseconds, on tmpfs microseconds.
    """
    shm = "/dev/shm"  # noqa: S108 (a private mkdtemp below it, mode 0700)
    for base in (os.environ.get("XDG_RUNTIME_DIR"), shm, os.environ.get("TMPDIR"), "/tmp"):  # noqa: S108
        if base and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            try:
                path = _mkdtemp(base)
            except OSError:
                continue
            sweep(base)
            with open(os.path.join(path, OWNER), "w") as f:
                f.write(_identity(os.getpid()) or "")
            return path
    raise SystemExit("execd: no writable directory for runtime files")


def _mkdtemp(base: str) -> str:
    """``tempfile.mkdtemp(prefix="execd-", dir=base)`` without importing tempfile (and
    random, and its hashes: memory every sandbox would carry for one call at start)."""
    for _ in range(100):
        path = os.path.join(base, "execd-" + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError("no free name under %s" % base)


def remove(path: str) -> None:
    """Remove a runtime dir, errors ignored (shutil is imported here, not at start: it
    pulls in zlib, bz2 and lzma, memory a sandbox would carry for its last call)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def sweep(base: str) -> int:
    """Remove runtime dirs under ``base`` whose recorded owner is gone."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        names = [n for n in os.listdir(base) if n.startswith("execd-")]
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, OWNER)) as f:
                pid_s, start_s, owner_ns = f.read().split(" ", 2)
        except (OSError, ValueError):
            continue  # no record (yet, or not ours): leave it alone
        if owner_ns != ns or not pid_s.isdigit():
            continue
        info = proc.read_stat(int(pid_s))
        if info is None or str(info.start) != start_s:
            remove(path)
            removed += 1
    return removed
