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
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scale import CPU, IMAGE, MEMORY, OUT, Harness, bare_pod, summary  # noqa: E402


def bare_create_to_ready(h: Harness, n: int, conc: int, tag: str) -> list[float]:
    """POST + wait for Ready on a watch, per pod, ``conc`` at a time (then delete)."""
    from broker.backends.kube.backend import pod_info

    ns = h.settings.namespace
    names = [f"bare-{tag}-{conc}-{i}" for i in range(n)]
    out: list[float] = []
    lock = threading.Lock()
    it = iter(names)

    def worker() -> None:
        while True:
            with lock:
                name = next(it, None)
            if name is None:
                return
            t0 = time.perf_counter()
            created = h.kube.create_pod(ns, bare_pod(name, ns, tag))
            version = created["metadata"]["resourceVersion"]
            for _kind, obj in h.kube.watch_pods(
                ns, field_selector=f"metadata.name={name}", resource_version=version, timeout_s=60
            ):
                if pod_info(obj, 0).ready:
                    break
            with lock:
                out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in names:
        h.kube.delete_pod(ns, name, uid=None)
    return out


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
    cluster = Path(
        os.environ.get("SANDMAN_CLUSTER_STATE", Path.home() / ".local/state/sandman/cluster")
    )
    plane = []
    for pidfile in (cluster / "pids").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            plane.append(int(pidfile.read_text().split()[0]))
    state = Path(h.settings.state_dir)
    roots = [os.getpid()]
    for pidfile in (state / "postgres" / "data" / "postmaster.pid", state / "redis" / "redis.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            roots.append(int(pidfile.read_text().split()[0]))
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


def acquire(h: Harness) -> Any:
    """One cold acquire of the smallest pod kwok accepts, through the trainer client."""
    return h.client.open(image=IMAGE, cpu=CPU, memory=MEMORY, job=h.job, timeout=300)


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
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--max-concurrent", type=int, default=256)
    parser.add_argument("--extra-acquire-workers", type=int, default=1)
    parser.add_argument("--release-timeout", type=float, default=600)
    parser.add_argument("--keep-namespace", action="store_true")
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
            acquire(h).release()
        print(f"{'':28} {'p50':>9} {'p99':>9}   (ms)", flush=True)
        for conc in [int(c) for c in args.concurrency.split(",")]:
            per = args.per if conc < 100 else 1
            bare = bare_create_to_ready(h, conc * per, conc, tag)
            lat: list[float] = []
            held: list[Any] = []
            lock = threading.Lock()

            def trainer(
                per: int = per,
                lat: list[float] = lat,
                held: list[Any] = held,
                lock: threading.Lock = lock,
            ) -> None:
                for _ in range(per):
                    sb = acquire(h)
                    with lock:
                        lat.append(sb.acquire_s)
                        held.append(sb)

            threads = [threading.Thread(target=trainer) for _ in range(conc)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
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
        OUT.mkdir(parents=True, exist_ok=True)
        name = "cold_kwok_isolated.json" if args.isolate_cpus else "cold_kwok.json"
        (OUT / name).write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {OUT / name}", flush=True)
    finally:
        restore(saved)
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
