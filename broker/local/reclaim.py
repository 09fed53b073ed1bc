"""What a stop of ``sandman up`` means on the local backend: drain, then kill what is left.

Why drain and not keep: a local sandbox is a process tree of this machine, held by no
cluster and no owner object; once its stack is gone nothing would ever settle its row
(a warm sandbox's lease never ends on its own). So a stop (Ctrl-C, SIGTERM) deletes every
sandbox of this installation through the provider, nonce-matched like a pod, so each row
closes with an audit event; after a bounded grace, whatever still runs under the stack
(its own descendants: the stack is a child subreaper, so a dead worker's sandboxes are
reparented to it, not to init) is killed outright. A stack that could not drain (it was
SIGKILLed, the machine lost power) leaves rows and processes; the next ``sandman up`` on
the same state dir runs the same reclaim before it starts any worker.

On the Kubernetes backend a stop leaves the pods to their leases and the GC: the cluster
outlives the laptop that started the stack, and its job owner objects remove the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from broker.acquire.root import Root
from broker.backends import localprocs
from broker.backends.local import LocalBackend
from broker.errors import SandmanError
from broker.ledger.models import Sandbox
from broker.ledger.states import LIVE_STATES
from broker.settings import Settings

PR_SET_CHILD_SUBREAPER = 36
ACTOR = "stack"


@dataclass
class Reclaim:
    """What one drain did: rows closed through the provider, processes killed after it."""

    released: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{len(self.released)} sandboxes released, {len(self.failed)} not confirmed, "
            f"{len(self.killed)} leftover processes killed"
        )


def become_subreaper() -> bool:
    """Make orphans of our descendants (a killed worker's sandboxes) our children, so the
    stack can still find and kill them by ancestry. False where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process we can see (one /proc scan)."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int, ppids: dict[int, int] | None = None) -> list[int]:
    """Every process below ``root`` (children first seen first), not ``root`` itself."""
    table = _ppids() if ppids is None else ppids
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def reap_orphans(keep: Iterable[int]) -> list[int]:
    """Collect exited processes reparented to us (deleted sandboxes of a dead worker),
    leaving our own ``Popen`` children (``keep``) to their objects: without this every
    such sandbox stays a zombie of the stack until it exits."""
    kept = set(keep)
    me = os.getpid()
    reaped = []
    for pid, ppid in _ppids().items():
        if ppid != me or pid in kept:
            continue
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                reaped.append(pid)
    return reaped


def marked_processes(state_dir: Path) -> list[int]:
    """This state dir's local sandboxes as the kernel shows them (the marker on their
    bubblewrap command line, ``broker.backends.localprocs``: the same scan the backend
    lists and deletes by), plus everything below them (execd and its commands)."""
    ppids = _ppids()
    roots = [p.pid for p in localprocs.scan(LocalBackend.mark_root_of(state_dir))]
    found = set(roots)
    for pid in roots:
        found.update(descendants(pid, ppids))
    return sorted(found)


def kill_all(pids: Iterable[int]) -> list[int]:
    """SIGKILL each pid (and its process group when it leads one); the ones signalled."""
    out = []
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            out.append(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
    return out


def _live_ids(root: Root, settings: Settings) -> list[str]:
    with root.sessions() as session:
        return list(
            session.scalars(
                select(Sandbox.id).where(
                    Sandbox.installation == settings.installation_id,
                    Sandbox.backend == "local",
                    Sandbox.state.in_([str(s) for s in LIVE_STATES]),
                )
            )
        )


def drain(
    settings: Settings,
    database_url: str,
    redis_url: str,
    *,
    grace_s: float = 30.0,
    below_us: bool = True,
) -> Reclaim:
    """Release this installation's local sandboxes through the provider (rows close,
    nonce-matched deletes), at most ``grace_s``; then kill every process still marked with
    this state dir and, with ``below_us`` (at a stop, once the caller's own children have
    exited), every process still below this one. At a start nothing of this state dir may
    be running yet, and the embedded services were not started below us, so both are safe."""
    report = Reclaim()
    root = Root(settings, database_url=database_url, redis_url=redis_url, actor=ACTOR)
    try:
        ids = _live_ids(root, settings) if settings.backend == "local" else []
        if ids:
            provider = root.provider()

            def release(sandbox_id: str) -> None:
                try:
                    provider.release(
                        sandbox_id, actor=ACTOR, reason="stack-stop", creator_gone=True
                    )
                    report.released.append(sandbox_id)
                except SandmanError:
                    report.failed.append(sandbox_id)

            pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="drain")
            futures = [pool.submit(release, i) for i in ids]
            _, pending = wait(futures, timeout=grace_s)
            pool.shutdown(wait=False, cancel_futures=True)
            if pending:
                report.failed.append(f"{len(pending)} not settled within {grace_s}s")
    except SandmanError as exc:
        report.failed.append(f"drain: {exc}")
    finally:
        root.dispose()
    left = set(marked_processes(settings.state_dir))
    if below_us:
        left.update(descendants(os.getpid()))
    # A zombie (a deleted sandbox its exited creator never waited for) is already dead:
    # it is reaped below, not counted as a survivor.
    report.killed = kill_all(sorted(pid for pid in left if _exists(pid)))
    reap_orphans(())
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_exists(p) for p in report.killed):
        reap_orphans(())
        time.sleep(0.05)
    return report


def _exists(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
