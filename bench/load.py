"""Sustained churn: acquire, 10 execs, release, as fast as the machine sustains, for minutes.

    .venv/bin/python bench/load.py                      # 10 minutes, 1-minute windows
    .venv/bin/python bench/load.py --duration 120 --window 30 --trainers 6

Own stack in a temporary state dir on free ports (embedded PostgreSQL and Redis, the two
Celery workers, local bubblewrap sandboxes running the real execd; no beat: one GC pass
runs at the end). Closed loop: ``--trainers`` threads each run the cycle back to back, so
the offered rate is what the machine sustains. Per window: cycles/s, acquire / exec /
cycle latency percentiles, errors, and the broker's memory (RSS of the worker processes).
At the end: drift of p50/p99 (last window vs first full window), memory growth (last vs
first window, per-window slope), and a leak check (ledger rows still live, pods left).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_env, free_port, pct, stop_services
from bench.meter import rss_mb

IMAGE = "localhost/sandman-task-base:v1"  # in the local store (make local-images)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--window", type=float, default=60.0, help="report window, seconds")
    p.add_argument("--trainers", type=int, default=4, help="concurrent churn loops")
    p.add_argument("--execs", type=int, default=10)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    state = Path(tempfile.mkdtemp(prefix="sandman-load-"))
    os.environ.update(
        bench_env(
            state,
            pg_port=free_port(),
            redis_port=free_port(),
            backend="local",
            installation=f"load-{secrets.token_hex(3)}",
            SANDMAN_CREATE_RATE="1000",
            SANDMAN_CREATE_BURST="1000",
            SANDMAN_GC_INTERVAL_S="3600",
            SANDMAN_LOG_LEVEL="WARNING",
        )
    )
    from sqlalchemy import func, select

    from broker.acquire.root import TOOL, Root
    from broker.client.sync import SandboxClient
    from broker.errors import SandmanError, ServiceUnavailable
    from broker.ledger import store
    from broker.ledger.models import Sandbox
    from broker.ledger.states import State
    from broker.local.stack import Stack
    from broker.settings import Settings

    settings = Settings.from_env()
    stack = Stack(settings)

    def cleanup() -> None:  # also after a crash: never leave our services running
        stack.stop()
        stop_services(settings)

    atexit.register(cleanup)
    print(f"starting the stack in {state} ...", file=sys.stderr, flush=True)
    try:
        stack.start(web=False, echo=False)
    except ServiceUnavailable:
        stack.wait_ready(timeout=300)  # a loaded machine: give the workers longer to start
    for name in [n for n in stack.procs if n == "beat"]:
        stack.procs.pop(name).kill()  # no beat: pool upkeep and GC stay out of the figures
    root = Root(settings, TOOL, database_url=stack.database_url, actor="load-gc")
    sessions = root.sessions
    with sessions.begin() as s:
        store.ensure_job(s, "load", lease_s=600.0)
    client = SandboxClient(stack.redis_url, owner="load", heartbeat_s=3600)
    broker_pids = [proc.pid for proc in stack.procs.values()]

    lock = threading.Lock()
    samples: list[tuple[float, str, float]] = []  # (t, kind, seconds)
    errors: list[tuple[float, str]] = []
    stop = threading.Event()
    t_start = time.monotonic()

    def loop() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                with client.acquire(
                    image=IMAGE, job="load", cpu="100m", memory="64Mi", timeout=120
                ) as sb:
                    t1 = time.monotonic()
                    exec_s = []
                    for i in range(args.execs):
                        e0 = time.monotonic()
                        r = sb.exec(f"echo {i}", timeout=30)
                        exec_s.append(time.monotonic() - e0)
                        if r.exit_code != 0:
                            raise RuntimeError(f"exec exit {r.exit_code}")
                t2 = time.monotonic()
                with lock:
                    samples.append((t2 - t_start, "acquire", t1 - t0))
                    samples.extend((t2 - t_start, "exec", v) for v in exec_s)
                    samples.append((t2 - t_start, "cycle", t2 - t0))
            except (SandmanError, RuntimeError) as exc:
                with lock:
                    errors.append((time.monotonic() - t_start, type(exc).__name__))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(args.trainers)]
    for t in threads:
        t.start()
    windows: list[dict[str, Any]] = []
    n_windows = max(1, round(args.duration / args.window))
    print(
        f"{'window':>10} {'cycles/s':>8} {'acq p50':>8} {'acq p99':>8} {'exec p50':>8} "
        f"{'exec p99':>8} {'cyc p50':>8} {'cyc p99':>8} {'err':>4} {'broker MB':>9}"
    )
    for w in range(n_windows):
        lo, hi = w * args.window, (w + 1) * args.window
        time.sleep(max(0.0, t_start + hi - time.monotonic()))
        with lock:
            got = [(k, v) for (t, k, v) in samples if lo <= t < hi]
            errs = Counter(k for (t, k) in errors if lo <= t < hi)
        by = {k: [v for kk, v in got if kk == k] for k in ("acquire", "exec", "cycle")}
        row = {
            "window": f"{lo:.0f}-{hi:.0f}s",
            "cycles": len(by["cycle"]),
            "rate": len(by["cycle"]) / args.window,
            **{f"{k}_p{q}_ms": pct(by[k], q) * 1000 for k in by for q in (50, 90, 99)},
            "errors": dict(errs),
            "broker_rss_mb": rss_mb(broker_pids),
        }
        windows.append(row)
        print(
            f"{row['window']:>10} {row['rate']:8.2f} {row['acquire_p50_ms']:8.0f} "
            f"{row['acquire_p99_ms']:8.0f} {row['exec_p50_ms']:8.1f} {row['exec_p99_ms']:8.1f} "
            f"{row['cycle_p50_ms']:8.0f} {row['cycle_p99_ms']:8.0f} {sum(errs.values()):4d} "
            f"{row['broker_rss_mb']:9.1f}",
            flush=True,
        )
    stop.set()
    for t in threads:
        t.join(timeout=150)

    # -- drift and growth ------------------------------------------------------------------
    base = windows[1] if len(windows) > 2 else windows[0]  # the first window warms up
    last = windows[-1]
    mem = [w["broker_rss_mb"] for w in windows]
    slope = (mem[-1] - mem[0]) / max(1, len(mem) - 1)
    total = sum(w["cycles"] for w in windows)
    summary = {
        "duration_s": args.duration,
        "trainers": args.trainers,
        "cycles": total,
        "throughput_cycles_per_s": total / (n_windows * args.window),
        "execs_per_s": total * args.execs / (n_windows * args.window),
        "errors": dict(Counter(k for _, k in errors)),
        "p50_cycle_drift_pct": 100 * (last["cycle_p50_ms"] / base["cycle_p50_ms"] - 1),
        "p99_cycle_drift_pct": 100 * (last["cycle_p99_ms"] / base["cycle_p99_ms"] - 1),
        "broker_rss_first_mb": mem[0],
        "broker_rss_last_mb": mem[-1],
        "broker_rss_slope_mb_per_window": slope,
    }
    time.sleep(3)  # releases in flight
    report = root.gc.run(actor=root.actor)
    with sessions() as s:
        summary["live_rows_after"] = int(
            s.scalar(
                select(func.count())
                .select_from(Sandbox)
                .where(Sandbox.state.not_in([State.DELETED, State.FAILED]))
            )
            or 0
        )
    summary["pods_left"] = len(
        root.need_backend().list_installation(settings.namespace, settings.installation_id)
    )
    summary["gc_unowned"] = len(report.unowned_pods)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "windows": windows}, indent=2))
    client.close()
    root.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
