"""Idle reclaim: how late after its timeout an idle held sandbox is reclaimed, at N held.

Runs its own stack (embedded PostgreSQL and Redis, the real Celery workers and beat of
``sandman up``, local bubblewrap sandboxes running the real execd) and measures, in one run:

  baseline   one idle sandbox alone, reclaimed ``--repeat`` times: the path's own latency
  N idle     N held sandboxes, each used once (an exec) at about the same moment, then left
             idle: latency = the ledger's reclaim (ready -> releasing, reason idle) minus
             (the moment the exec was SENT + the timeout), so never flattering
  busy       B more held sandboxes running a command 1.5 times as long as the timeout: none
             may be reclaimed before its command ended (reported as violations), and each
             is reclaimed after its end plus the timeout

The timeout is set on the job only after every sandbox was used (the reconcile puts their
deadlines in), so the creates do not compete with the sweeps being measured.

    .venv/bin/python bench/idle_reclaim.py --n 1000 --timeout-s 60
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ms, pct, run_threads, save, stop_services

IMAGE = "localhost/sandman-task-base:v1"  # in the local store (make local-images)


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def line(name: str, values: list[float], baseline: float | None = None) -> str:
    ratio = f"  x{pct(values, 50) / baseline:.2f} of the baseline p50" if baseline else ""
    return (
        f"{name:<30} n={len(values):<5} p50={ms(pct(values, 50))} p99={ms(pct(values, 99))}"
        f" max={ms(max(values) if values else float('nan'))}{ratio}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="idle held sandboxes")
    parser.add_argument("--busy", type=int, default=10, help="held sandboxes running a command")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=5, help="baseline reclaims")
    parser.add_argument("--threads", type=int, default=32, help="trainer threads")
    parser.add_argument(
        "--min-free-mb", type=float, default=3000, help="stop acquiring below this MemAvailable"
    )
    args = parser.parse_args()
    os.environ.setdefault("SANDMAN_CREATE_RATE", "1000")
    os.environ.setdefault("SANDMAN_CREATE_BURST", "1000")

    from sqlalchemy import select

    from broker.client.sync import Sandbox, SandboxClient
    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory
    from broker.ledger.models import Event
    from broker.local.stack import Stack, running_stack
    from broker.names import IDLE_DEADLINES_KEY
    from broker.settings import Settings

    settings = Settings.from_env()
    if running_stack(settings):
        print("a `sandman up` is running on this state dir; stop it first", file=sys.stderr)
        return 2
    stack = Stack(settings)
    print("starting the stack ...", flush=True)
    stack.start(web=False, echo=False)
    sessions = make_session_factory(make_engine(stack.database_url))
    client = SandboxClient(stack.redis_url, owner="bench-idle", heartbeat_s=3600)
    tag = secrets.token_hex(2)
    timeout_s = args.timeout_s

    def set_job(name: str, **config: Any) -> str:
        with sessions.begin() as session:
            store.ensure_job(session, name, egress="deny", **config)
        return name

    def reclaimed_at(ids: list[str]) -> dict[str, float]:
        with sessions() as session:
            events = session.scalars(
                select(Event).where(
                    Event.sandbox_id.in_(ids),
                    Event.kind == "transition",
                    Event.to_state == "releasing",
                )
            ).all()
            return {
                e.sandbox_id: e.at.timestamp()
                for e in events
                if e.sandbox_id and (e.detail or {}).get("reason") == "idle"
            }

    def wait_reclaimed(ids: list[str], limit_s: float) -> dict[str, float]:
        deadline = time.monotonic() + limit_s
        while True:
            got = reclaimed_at(ids)
            if len(got) == len(ids) or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def acquire(job: str, n: int) -> list[Sandbox]:
        lock = threading.Lock()
        count = iter(range(n))
        out: list[Sandbox] = []

        def one() -> None:
            while True:
                with lock:
                    if next(count, None) is None:
                        return
                if available_mb() < args.min_free_mb:
                    return  # the machine is shared: stop here, report the N reached
                sb = client.open(image=IMAGE, job=job, cpu="100m", memory="64Mi", timeout=900)
                with lock:
                    out.append(sb)
                    if len(out) % 50 == 0:
                        print(f"  {len(out)}/{n} held", flush=True)

        run_threads(min(args.threads, n), 1, one)
        return out

    def touch(sandboxes: list[Sandbox]) -> dict[str, float]:
        """One exec each, concurrently; the moment each was sent."""
        sent: dict[str, float] = {}
        queue = iter(sandboxes)
        lock = threading.Lock()

        def one() -> None:
            while True:
                with lock:
                    sb = next(queue, None)
                if sb is None:
                    return
                at = time.time()
                assert sb.exec("true").ok
                sent[sb.id] = at

        run_threads(min(args.threads, len(sandboxes)), 1, one)
        return sent

    doc: dict[str, Any] = {"n": args.n, "busy": args.busy, "timeout_s": timeout_s}
    try:
        # -- baseline: one idle sandbox alone -------------------------------------
        # Registered at its hand-out (the real path), used at once, then left idle.
        base_t = 5.0
        base_job = set_job(f"idle-base-{tag}", idle_timeout_s=base_t)
        base: list[float] = []
        for _ in range(args.repeat):
            (sb,) = acquire(base_job, 1)
            sent = touch([sb])
            got = wait_reclaimed([sb.id], 120)
            base.append(got[sb.id] - (sent[sb.id] + base_t))
        print(line("baseline: 1 idle, alone", base), flush=True)

        # -- N idle and B busy held sandboxes ---------------------------------------
        job = set_job(f"idle-bench-{tag}", idle_timeout_s=None)
        before_mb = available_mb()
        t0 = time.monotonic()
        idle = acquire(job, args.n)
        busy = acquire(job, args.busy)
        held_s = time.monotonic() - t0
        per_mb = (before_mb - available_mb()) / max(1, len(idle) + len(busy))
        print(
            f"held {len(idle) + len(busy)} sandboxes in {held_s:.0f} s; "
            f"~{per_mb:.1f} MB of RAM each",
            flush=True,
        )
        sent = touch(idle)
        ends: dict[str, float] = {}
        starts: dict[str, float] = {}
        long_s = 1.5 * timeout_s

        def busy_run(sb: Sandbox) -> None:
            starts[sb.id] = time.time()
            result = sb.exec(f"sleep {long_s}", timeout=long_s + 60)
            assert result.ok, result
            ends[sb.id] = time.time()

        workers = [threading.Thread(target=busy_run, args=(sb,)) for sb in busy]
        for w in workers:
            w.start()
        set_job(job, idle_timeout_s=timeout_s)
        client.redis.delete(IDLE_DEADLINES_KEY + ":reconcile")
        registered_late = 0
        while client.redis.zcard(IDLE_DEADLINES_KEY) < len(idle) + len(busy):
            time.sleep(0.1)
        registered_after = time.time() - min(sent.values())
        if registered_after > timeout_s:
            registered_late = 1  # a deadline registered after it passed: latency inflated
        spread = max(sent.values()) - min(sent.values())
        print(
            f"used all {len(sent)} within {spread:.1f} s; every deadline registered "
            f"{registered_after:.1f} s after the first use",
            flush=True,
        )
        for w in workers:
            w.join()
        ids = [sb.id for sb in idle]
        doc["n"] = len(ids)
        got = wait_reclaimed(ids + [sb.id for sb in busy], 600)
        lat = [got[i] - (sent[i] + timeout_s) for i in ids if i in got]
        early = [i for i in ids if i in got and got[i] < sent[i] + timeout_s]
        violations = [sb.id for sb in busy if sb.id in got and got[sb.id] < starts[sb.id] + long_s]
        busy_lat = [
            got[sb.id] - (ends[sb.id] + timeout_s) for sb in busy if sb.id in got and sb.id in ends
        ]
        base_p50 = pct(base, 50)
        print(line(f"N={len(ids)} idle, reclaim latency", lat, base_p50))
        print(
            f"{'':<30} reclaimed {len(lat)}/{len(ids)}; before the timeout: {len(early)}; "
            f"within 5 s after it: {sum(1 for v in lat if v <= 5.0)}"
        )
        print(
            f"busy: {len(busy)} sandboxes running `sleep {long_s:g}` (timeout {timeout_s:g} s): "
            f"reclaimed while the command ran: {len(violations)}; "
            f"after end + timeout: p50 {pct(busy_lat, 50):.2f} s, max "
            f"{max(busy_lat) if busy_lat else float('nan'):.2f} s (end measured by the trainer)"
        )
        if registered_late:
            print("WARNING: deadlines registered after the first timeout passed", flush=True)
        doc.update(
            baseline_s=base,
            latency_s=lat,
            early=len(early),
            busy_violations=len(violations),
            busy_latency_s=busy_lat,
            acquire_s=held_s,
            ram_mb_each=per_mb,
            registered_late=registered_late,
            touch_spread_s=spread,
        )
        save("idle_reclaim", doc)
        return 0 if not violations and not early and len(lat) == len(ids) else 1
    finally:
        client.close()
        stack.stop(echo=lambda _line: None)
        stop_services(settings)  # the stack leaves the embedded services running


if __name__ == "__main__":
    sys.exit(main())
