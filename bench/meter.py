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


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mb(pids: list[int]) -> float:
    """Resident memory of ``pids`` together, in MiB (gone processes count 0)."""
    return sum((proc_stat(p) or (0.0, 0, 0))[1] for p in pids) / 2**20


class Meter:
    """CPU and memory of named process groups, sampled by the progress loop."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.start = {name: self._cpu(pids) for name, pids in groups.items()}
        self.t0 = time.monotonic()
        self.last = dict(self.start)
        self.last_t = self.t0
        self.peak_rss = dict.fromkeys(groups, 0)
        self.samples: list[dict[str, Any]] = []

    def _cpu(self, pids: list[int]) -> float:
        return sum((proc_stat(p) or (0.0, 0, 0))[0] for p in pids)

    def sample(self) -> dict[str, float]:
        now = time.monotonic()
        out: dict[str, float] = {}
        for name, pids in self.groups.items():
            stats = [s for p in pids if (s := proc_stat(p))]
            cpu = sum(s[0] for s in stats)
            rss = sum(s[1] for s in stats)
            self.peak_rss[name] = max(self.peak_rss[name], rss, sum(s[2] for s in stats))
            out[f"{name}_cpu_pct"] = 100 * (cpu - self.last[name]) / max(1e-6, now - self.last_t)
            out[f"{name}_rss_mb"] = rss / 2**20
            self.last[name] = cpu
        self.last_t = now
        return out

    def totals(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        return {
            name: {
                "cpu_s": self._cpu(pids) - self.start[name],
                "wall_s": wall,
                "avg_cores": (self._cpu(pids) - self.start[name]) / wall,
                "peak_rss_mb": self.peak_rss[name] / 2**20,
            }
            for name, pids in self.groups.items()
        }
