"""Scale run: hold 12,000+ sandboxes on the local cluster's kwok nodes through the full stack.

    .venv/bin/python bench/scale.py [--target 12000] [--rate 40] [--burst 40]

Full stack on kwok nodes, **readiness simulated** (see bench/kube_stack.py).

Phases: bare API create-rate baseline (plain client, no broker) -> ramp (acquires offered at
the pacer's rate, progress every 5 s) -> one GC pass at full scale (timed) -> release all ->
leak check (GC pass, ledger, cluster) -> cleanup. Writes bench/out/scale.json, read by
bench/report.py. Uses its own installation id, namespace, state dir and service ports.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import achieved_rate, rate_series, save, summary
from bench.kube_stack import CPU, IMAGE, MEMORY, Harness, column, stack_arguments
from bench.kwok import kwok_pod
from bench.meter import Meter, cpu_table, per_create


def bare_pod(name: str, namespace: str, tag: str) -> dict[str, Any]:
    """The broker's pod shape without the broker: what a plain client would create."""
    return kwok_pod(
        name,
        {"bench-bare": tag},
        image=IMAGE,
        container="main",
        namespace=namespace,
        resources={
            "requests": {"cpu": CPU, "memory": MEMORY},
            "limits": {"cpu": CPU, "memory": MEMORY},
        },
        spec={"enableServiceLinks": False, "automountServiceAccountToken": False},
    )


def bare_baseline(kube: Any, namespace: str, n: int, threads: int, tag: str) -> dict[str, Any]:
    """A plain client creating pods as fast as it can (no ledger, no pacer), then deleting."""
    names = [f"bare-{tag}-{i}" for i in range(n)]
    lat: list[float] = []
    lock = threading.Lock()

    def create(name: str) -> None:
        t = time.perf_counter()
        kube.create_pod(namespace, bare_pod(name, namespace, tag))
        with lock:
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, names))
    wall = time.perf_counter() - t0
    # time until all are Ready (kwok)
    ready_deadline = time.monotonic() + 300
    while time.monotonic() < ready_deadline:
        pods, _ = kube.list_pods(namespace, f"bench-bare={tag}")
        ready = sum(
            1
            for p in pods
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        )
        if ready >= n:
            break
        time.sleep(1)
    all_ready_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda nm: kube.delete_pod(namespace, nm, uid=None), names))
    delete_s = time.perf_counter() - t1
    while kube.list_pods(namespace, f"bench-bare={tag}")[0]:
        time.sleep(1)
    return {
        "n": n,
        "threads": threads,
        "create_wall_s": wall,
        "create_rate": n / wall,
        "create_call": summary(lat),
        "all_ready_s": all_ready_s,
        "delete_rate": n / delete_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=int, default=12000)
    parser.add_argument("--offered", type=float, default=None, help="acquires/s (default: rate)")
    parser.add_argument("--bare-n", type=int, default=1000)
    parser.add_argument("--max-ramp-s", type=float, default=3600, help="ramp deadline")
    stack_arguments(parser, rate=40.0, burst=40, waiters=256, release_timeout=1800)
    args = parser.parse_args()
    tag = f"scale-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    print(
        f"scale run {tag}: target {args.target}, pacer {args.rate}/s burst {args.burst}", flush=True
    )
    doc: dict[str, Any] = {
        "tag": tag,
        "args": vars(args),
        "readiness": "SIMULATED (kwok: no execd poll)",
    }
    series: list[dict[str, Any]] = []
    with Harness(args, tag) as h:
        print("bare API baseline ...", flush=True)
        doc["bare_api"] = bare_baseline(h.kube, h.settings.namespace, args.bare_n, 32, tag)
        print(f"bare API: {doc['bare_api']['create_rate']:.1f} creates/s", flush=True)
        h.meter = Meter(h.meter.groups, h.meter.flat)  # usage over the ramp only
        ramp_t0 = time.time()
        got = h.offer(
            args.target,
            args.offered or args.rate,
            timeout=args.max_ramp_s,
            on_progress=h.progress_printer("ramp", series),
        )
        doc["ramp_wall_s"] = got["wall_s"]
        doc["usage_ramp"] = h.meter.totals()
        doc["held_peak"] = len(got["held"])
        doc["errors"] = got["errors"][:20]
        doc["error_count"] = len(got["errors"])
        doc["client_acquire_s"] = summary(got["client_acquire_s"])
        print(
            f"held {len(got['held'])} concurrently; errors {len(got['errors'])}; GC pass ...",
            flush=True,
        )
        doc["gc_full_scale"] = h.gc_pass()
        print(f"GC pass at full scale: {doc['gc_full_scale']}", flush=True)
        rows = h.ledger_rows()
        stamps = column(rows, "creating_at")
        ready = column(rows, "ready_at")
        doc["hist_create_to_ready"] = column(rows, "create_to_ready_s")
        doc["hist_acquire"] = column(rows, "acquire_latency_s")
        doc["create_to_ready_s"] = summary(doc["hist_create_to_ready"])
        doc["acquire_latency_s"] = summary(doc["hist_acquire"])
        doc["achieved_create_rate"] = achieved_rate(stamps, args.burst)
        # Where each create's CPU went over the ramp: broker processes, the embedded
        # services, the control plane, the bench's own client.
        doc["ramp_creates"] = len(stamps)
        doc["cpu_per_create_ms"] = per_create(doc["usage_ramp"], len(stamps))
        print(f"CPU over the ramp, {len(stamps)} creates:", flush=True)
        print(cpu_table(doc["usage_ramp"], len(stamps)), flush=True)
        doc["pacer_rate"] = args.rate
        doc["create_rate_series"] = rate_series(stamps, ramp_t0)
        doc["live_series"] = [(p["t"], p["live"]) for p in series]
        doc["ready_series"] = rate_series(ready, ramp_t0)
        doc["simulated_rows"] = sum(1 for r in rows if r["simulated"])
        doc["api_outcomes"] = h.api_outcomes()
        doc["progress"] = series
        save("scale", doc)  # the ramp's figures survive a teardown that fails
        h.release_and_check(got["held"], doc)
        doc["release_rate"] = len(got["held"]) / doc["release_wall_s"]
        doc["ledger"] = h.ledger_size()
        save("scale", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
