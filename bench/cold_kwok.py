"""Cold acquires on kwok nodes: the broker's own overhead, the API server and node excluded.

    .venv/bin/python bench/cold_kwok.py [--per 20]

Full stack (trainer client -> Redis -> Celery acquire worker -> pacer -> ledger ->
kube-apiserver -> kwok). Readiness is SIMULATED (kwok pods run no execd). Pacing is off
(rate 1000/s) so only the broker's work is measured.

For each acquire the provider records, in its ``ready`` audit row, ``api_s``: the time
from sending the pod create to seeing it Ready on the shared watch, i.e. what the API
server, scheduler and (fake) node took. Broker overhead = the trainer's acquire latency
minus that. Baseline, same run: a bare client doing POST + watch-until-Ready for the
same pod shape, at the same concurrency (what any broker would pay at least).

Concurrency 1, 10 and 100 trainer threads; each does ``--per`` acquires (100: one each),
holds them, then releases them all. Writes bench/out/cold_kwok.json.

``--isolate-cpus`` puts the control plane on the last CPU and the broker side on the
others, so that at 10 and 100 concurrent creates the broker's figure is not mostly time
spent waiting for a core the API server holds (on a 2-CPU host both sides otherwise
saturate together). Writes bench/out/cold_kwok_isolated.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import run_threads, save, summary
from bench.kube_stack import Harness, stack_arguments
from bench.meter import cluster_pids, read_pid
from bench.scale import bare_pod


def bare_create_to_ready(h: Harness, n: int, conc: int, tag: str) -> list[float]:
    """POST + wait for Ready on a watch, per pod, ``conc`` at a time (then delete)."""
    from broker.backends.kube.backend import pod_info

    ns = h.settings.namespace
    names = iter([f"bare-{tag}-{conc}-{i}" for i in range(n)])
    lock = threading.Lock()

    def one() -> tuple[str, float]:
        with lock:
            name = next(names)
        t0 = time.perf_counter()
        created = h.kube.create_pod(ns, bare_pod(name, ns, tag))
        version = created["metadata"]["resourceVersion"]
        for _kind, obj in h.kube.watch_pods(
            ns, field_selector=f"metadata.name={name}", resource_version=version, timeout_s=60
        ):
            if pod_info(obj, 0).ready:
                break
        return name, time.perf_counter() - t0

    done = run_threads(conc, n // conc, one)
    for name, _ in done:
        h.kube.delete_pod(ns, name, uid=None)
    return [seconds for _, seconds in done]


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(
                int(line.split()[1])
                for line in status.read_text().splitlines()
                if line.startswith("PPid:")
            )
        except (OSError, StopIteration, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(status.parent.name))
    return kids


def _with_descendants(roots: list[int]) -> list[int]:
    kids, out, todo = _children_map(), [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += kids.get(pid, [])
    return out


def _pin(pids: list[int], cpus: set[int], saved: dict[int, set[int]]) -> None:
    """Set the CPU affinity of every thread of ``pids`` (new threads inherit it)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            tid = int(task.name)
            try:
                saved.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cpus)
            except OSError:
                continue  # the thread ended meanwhile


def isolate(h: Harness) -> dict[int, set[int]]:
    """Control plane on the last CPU, the broker side (this process, its workers,
    PostgreSQL, Redis) on the others: the broker's latency then excludes queueing behind
    the API server for a core, which is what "overhead excluding the API server" means,
    and how a real deployment runs (control plane on other machines)."""
    cpus = sorted(os.sched_getaffinity(0))
    control, broker_cpus = {cpus[-1]}, set(cpus[:-1])
    plane = [pid for pids in cluster_pids(None).values() for pid in pids]
    state = Path(h.settings.state_dir)
    services = (state / "postgres" / "data" / "postmaster.pid", state / "redis" / "redis.pid")
    roots = [os.getpid(), *(pid for f in services if (pid := read_pid(f)) is not None)]
    saved: dict[int, set[int]] = {}
    _pin(_with_descendants(plane), control, saved)
    _pin(_with_descendants(roots), broker_cpus, saved)
    print(f"CPU isolation: control plane on {sorted(control)}, broker on {sorted(broker_cpus)}")
    return saved


def restore(saved: dict[int, set[int]]) -> None:
    for tid, cpus in saved.items():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)
    # Threads started while pinned inherited the pin: widen every thread of those
    # processes back to all CPUs.
    everything = set(range(os.cpu_count() or 1))
    for tid in saved:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{tid}/task").glob("*"):
                os.sched_setaffinity(int(task.name), everything)


def ready_api_s(h: Harness, sandbox_ids: list[str]) -> dict[str, float]:
    from sqlalchemy import select

    from broker.ledger.models import Event

    with h.sessions() as session:
        rows = session.execute(
            select(Event.sandbox_id, Event.detail).where(
                Event.sandbox_id.in_(sandbox_ids), Event.kind == "api", Event.action == "ready"
            )
        ).all()
    return {sid: float(detail["api_s"]) for sid, detail in rows if "api_s" in (detail or {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per", type=int, default=20, help="acquires per thread at c=1, 10")
    parser.add_argument("--concurrency", default="1,10,100")
    stack_arguments(
        parser, rate=1000.0, burst=1000, waiters=1, release_timeout=600, extra_acquire_workers=1
    )
    parser.add_argument(
        "--isolate-cpus",
        action="store_true",
        help="control plane on the last CPU, the broker on the others (see isolate())",
    )
    args = parser.parse_args()
    tag = f"cold-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    h = Harness(args, tag)
    doc: dict[str, Any] = {
        "tag": tag,
        "readiness": "SIMULATED (kwok: no execd poll)",
        "isolate_cpus": args.isolate_cpus,
    }
    saved: dict[int, set[int]] = {}
    try:
        if args.isolate_cpus:
            saved = isolate(h)
        # Warm up: first creates pay for connection pools, configmaps and the owner object.
        for _ in range(3):
            h.open().release()
        print(f"{'':28} {'p50':>9} {'p99':>9}   (ms)", flush=True)
        for conc in [int(c) for c in args.concurrency.split(",")]:
            per = args.per if conc < 100 else 1
            bare = bare_create_to_ready(h, conc * per, conc, tag)
            held: list[Any] = run_threads(conc, per, h.open)
            lat = [sb.acquire_s for sb in held]
            api = ready_api_s(h, [sb.id for sb in held])
            overhead = [sb.acquire_s - api[sb.id] for sb in held if sb.id in api]
            for sb in held:
                sb.release()
            result = {
                "acquire_s": summary(lat),
                "api_and_node_s": summary(list(api.values())),
                "broker_overhead_s": summary(overhead),
                "baseline_bare_create_to_ready_s": summary(bare),
            }
            doc[f"c{conc}"] = result
            for label, key in (
                ("acquire (trainer)", "acquire_s"),
                ("  of which API+node", "api_and_node_s"),
                ("  broker overhead", "broker_overhead_s"),
                ("baseline: bare POST->Ready", "baseline_bare_create_to_ready_s"),
            ):
                s = result[key]
                print(
                    f"c={conc:<3} {label:<28} {s['p50'] * 1000:9.1f} {s['p99'] * 1000:9.1f}",
                    flush=True,
                )
            h.release_all([], f"drain c={conc}", [])
        save("cold_kwok_isolated" if args.isolate_cpus else "cold_kwok", doc)
    finally:
        restore(saved)
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
