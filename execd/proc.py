"""Process table reading and process-tree killing, from /proc.

Timeouts and resets must kill everything a command started, including
processes that left its process group (``setsid``, double forks). Those are
found structurally: execd is PID 1 or a child subreaper, so every orphan of the
session is re-parented to execd and stays inside the tree rooted at it.
Processes are stopped first and killed after a rescan, so a fork racing the
kill cannot escape.
"""

from __future__ import annotations

import os
import signal
import time

from .errors import suppress

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Set
else:
    from .records import NamedTuple


class ProcInfo(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    state: str
    start: int  # clock ticks since boot: (pid, start) names a process uniquely


if TYPE_CHECKING:
    # pid -> its /proc/<pid>/stat, one snapshot of the process table
    Table = Dict[int, ProcInfo]


def read_stat(pid: int) -> Optional[ProcInfo]:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: fields start after the last ')'.
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcInfo(pid, int(rest[1]), int(rest[2]), rest[0].decode(), int(rest[19]))
    except (IndexError, ValueError):
        return None


def proc_table() -> Dict[int, ProcInfo]:
    table: Dict[int, ProcInfo] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (a bare bubblewrap): callers fall back to process groups
        return table
    for name in names:
        if name.isdigit():
            info = read_stat(int(name))
            if info is not None:
                table[info.pid] = info
    return table


def children_map(table: Dict[int, ProcInfo]) -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for info in table.values():
        kids.setdefault(info.ppid, []).append(info.pid)
    return kids


def descendants(table: Dict[int, ProcInfo], roots: Iterable[int]) -> Set[int]:
    """All processes below ``roots`` (the roots themselves excluded)."""
    kids = children_map(table)
    out: Set[int] = set()
    stack = list(roots)
    while stack:
        for child in kids.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def direct_children(pid: int) -> Set[int]:
    """Cheap (one small read) list of a single-threaded process's children."""
    try:  # os-level calls: this runs before every command, keep it cheap
        fd = os.open("/proc/%d/task/%d/children" % (pid, pid), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return {int(x) for x in os.read(fd, 65536).split()}
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return set()


def environ_value(pid: int, name: bytes) -> Optional[bytes]:
    """The value of one variable in a process's (exec-time) environment."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    prefix = name + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :]
    return None


def cmdline(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:300]


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_tree(select: Callable[[Table], Set[int]], rounds: int = 5) -> int:
    """Freeze then kill the processes ``select(table)`` returns; returns how many.

    ``select`` is re-evaluated on a fresh table each round so children forked
    while we were stopping their parents are caught too.
    """
    frozen: Set[int] = set()
    for _ in range(rounds):
        found = set(select(proc_table())) - frozen
        if not found:
            break
        _signal_all(found, signal.SIGSTOP)
        frozen |= found
    _signal_all(frozen, signal.SIGKILL)
    return len(frozen)


def wait_gone(pids: Iterable[int], timeout: float) -> bool:
    """Wait until no pid in ``pids`` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending:
        pending = {p for p in pending if _alive(p)}
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _alive(pid: int) -> bool:
    info = read_stat(pid)
    return info is not None and info.state not in ("Z", "X")
