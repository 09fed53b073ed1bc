"""CPU and memory of the processes behind a bench: the broker, the control plane, the bench.

A throughput figure means little without what it cost; the scale and burst runs report
both, sampled from /proc (no psutil: one less dependency for a figure this simple). The
local cluster's components are found by the pid files deploy/localcluster/up.sh writes.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

CONTROL_PLANE = ("kube-apiserver", "etcd", "kwok", "kube-scheduler", "kube-controller-manager")


def read_pid(path: Path) -> int | None:
    """The pid in a pid file (its first word), or None when there is none to read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(path.read_text().split()[0])
    return None


def cluster_state() -> Path:
    """The local cluster's state dir (pid files under ``pids/``)."""
    return Path(
        os.environ.get("SANDMAN_CLUSTER_STATE", Path.home() / ".local/state/sandman/cluster")
    )


def cluster_pids(components: tuple[str, ...] | None = CONTROL_PLANE) -> dict[str, list[int]]:
    """Pids of the local cluster's components by name (``None``: every pid file there)."""
    pids = cluster_state() / "pids"
    files = (
        [pids / f"{c}.pid" for c in components] if components is not None else pids.glob("*.pid")
    )
    return {f.stem: [pid] for f in files if (pid := read_pid(f)) is not None}


def service_pids(state_dir: Path) -> dict[str, list[int]]:
    """The embedded PostgreSQL (postmaster) and Redis of a state dir, by their pid files."""
    found = {
        "postgres": read_pid(state_dir / "postgres" / "data" / "postmaster.pid"),
        "redis": read_pid(state_dir / "redis" / "redis.pid"),
    }
    return {name: [pid] for name, pid in found.items() if pid is not None}


FLAT = frozenset({"bench_client"})  # the bench's own children are the broker's processes


def proc_stat(pid: int) -> tuple[float, int, int] | None:
    """(cpu seconds, rss bytes, peak rss bytes) of one process, or None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    kb = {
        line.split(":")[0]: int(line.split()[1])
        for line in status.splitlines()
        if line.startswith(("VmRSS", "VmHWM"))
    }
    return cpu, kb.get("VmRSS", 0) * 1024, kb.get("VmHWM", 0) * 1024


def children_map() -> dict[int, list[int]]:
    """Every process's children (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid`` and every process below it (one pass over /proc unless ``children``)."""
    children = children_map() if children is None else children
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_cpu(roots: list[int], children: dict[int, list[int]]) -> float:
    """CPU seconds of ``roots`` and every process below them, exited ones included.

    An exited child's time is in its parent's cutime/cstime once reaped, so summing all
    four fields over the live tree counts each process once (a PostgreSQL backend forked
    mid-run and gone before the end still counts)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in {p for root in roots for p in descendants(root, children)}:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])
    return total / tick


def rss_mb(pids: list[int]) -> float:
    """Resident memory of ``pids`` together, in MiB (gone processes count 0)."""
    return sum((proc_stat(p) or (0.0, 0, 0))[1] for p in pids) / 2**20


class Meter:
    """CPU and memory of named process groups, sampled by the progress loop.

    A group's CPU is that of its processes' whole trees (``tree_cpu``): PostgreSQL forks a
    backend per connection after the meter started; memory is the listed processes'."""

    def __init__(self, groups: dict[str, list[int]], flat: frozenset[str] = frozenset()) -> None:
        self.groups = groups
        self.flat = flat  # groups counted without their children (``FLAT``)
        self.start = self._cpu_all()
        self.t0 = time.monotonic()
        self.last = dict(self.start)
        self.last_t = self.t0
        self.peak_rss = dict.fromkeys(groups, 0)
        self.samples: list[dict[str, Any]] = []

    def _cpu_all(self) -> dict[str, float]:
        children = children_map()
        return {
            name: tree_cpu(pids, {} if name in self.flat else children)
            for name, pids in self.groups.items()
        }

    def sample(self) -> dict[str, float]:
        now = time.monotonic()
        out: dict[str, float] = {}
        used = self._cpu_all()
        for name, pids in self.groups.items():
            stats = [s for p in pids if (s := proc_stat(p))]
            cpu = used[name]
            rss = sum(s[1] for s in stats)
            self.peak_rss[name] = max(self.peak_rss[name], rss, sum(s[2] for s in stats))
            out[f"{name}_cpu_pct"] = 100 * (cpu - self.last[name]) / max(1e-6, now - self.last_t)
            out[f"{name}_rss_mb"] = rss / 2**20
            self.last[name] = cpu
        self.last_t = now
        return out

    def totals(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        now = self._cpu_all()
        used = {name: now[name] - self.start[name] for name in self.groups}
        return {
            name: {
                "cpu_s": used[name],
                "wall_s": wall,
                "avg_cores": used[name] / wall,
                "peak_rss_mb": self.peak_rss[name] / 2**20,
            }
            for name in self.groups
        }


def per_create(usage: dict[str, Any], creates: int) -> dict[str, float]:
    """Milliseconds of CPU per create of each group in ``usage`` (a ``Meter.totals()``)."""
    return {name: 1000 * u["cpu_s"] / max(1, creates) for name, u in usage.items()}


def cpu_table(usage: dict[str, Any], creates: int) -> str:
    """Each group's CPU seconds, average cores and CPU per create, as a text table."""
    lines = [f"{'component':26s} {'CPU-s':>8s} {'cores':>6s} {'ms/create':>10s}"]
    for name, ms in per_create(usage, creates).items():
        u = usage[name]
        lines.append(f"{name:26s} {u['cpu_s']:8.1f} {u['avg_cores']:6.2f} {ms:10.2f}")
    return "\n".join(lines)
