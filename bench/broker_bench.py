"""Acquire latency through the whole stack, pacing accuracy, and sustained throughput.

Runs its own stack (embedded PostgreSQL and Redis, real Celery workers, local bubblewrap
sandboxes) and prints every figure next to the baseline it is compared to, measured in
the same run:

  warm hit (c=1/10/100)      vs a bare Redis round trip (the floor of any hit)
  cold acquire (c=1/10/100)  vs the local backend's bare create-to-ready
  pacing accuracy            achieved create rate vs the configured one; burst never exceeded
  acquire+release throughput with pacing off

    .venv/bin/python bench/broker_bench.py [--duration 60] [--quick]
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    achieved_rate,
    acquire_request,
    ms,
    pacing_windows,
    pct,
    run_threads,
)
from broker.names import Queue, Task

IMAGE = "localhost/sandman-task-base:v1"  # in the local store (make local-images)
LIVE = ("requested", "creating", "ready", "releasing")


def line(name: str, values: list[float], baseline: str = "") -> None:
    print(
        f"{name:<28} n={len(values):<4} p50={ms(pct(values, 50))} p99={ms(pct(values, 99))}"
        f"  {baseline}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=15.0, help="pacing run, seconds")
    parser.add_argument("--throughput-s", type=float, default=10.0)
    # Local creates on a 2-CPU VM saturate near 4.4/s: pace below that to measure the pacer.
    parser.add_argument("--pace-rate", type=float, default=3.0)
    parser.add_argument("--pace-burst", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller counts")
    parser.add_argument("--phases", default="warm,cold,pace,throughput")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    # Pacing "off" globally; the pacing phase sets a per-job rate instead.
    os.environ.setdefault("SANDMAN_CREATE_RATE", "1000")
    os.environ.setdefault("SANDMAN_CREATE_BURST", "1000")
    os.environ.setdefault("SANDMAN_MAX_CONCURRENT_CREATES", "64")

    import redis
    from sqlalchemy import select

    from broker.backends.base import PodSpec
    from broker.backends.local import LocalBackend
    from broker.client.sync import SandboxClient
    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory
    from broker.ledger.models import Sandbox
    from broker.local.stack import Stack, running_stack
    from broker.pools.store import WarmStore, pool_key
    from broker.settings import Settings

    settings = Settings.from_env()
    if running_stack(settings):
        print("a `sandman up` is running on this state dir; stop it first", file=sys.stderr)
        return 2
    stack = Stack(settings)
    print("starting the stack ...", flush=True)
    stack.start(web=False, echo=False)
    sessions = make_session_factory(make_engine(stack.database_url))
    client = SandboxClient(stack.redis_url, owner="bench", heartbeat_s=3600)
    bare = redis.Redis.from_url(stack.redis_url)
    tag = secrets.token_hex(2)

    def drained(job_like: str, timeout: float = 120) -> None:
        """Wait until the previous phase's sandboxes are gone: no CPU stolen from the next."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with sessions() as session:
                left = session.scalars(
                    select(Sandbox.id).where(Sandbox.job.like(job_like), Sandbox.state.in_(LIVE))
                ).all()
            if not left:
                return
            time.sleep(0.5)

    try:
        # -- baselines ---------------------------------------------------------------
        rtt = []
        for _ in range(500):
            t0 = time.perf_counter()
            bare.ping()
            rtt.append(time.perf_counter() - t0)
        backend = LocalBackend(settings)
        bare_create = []
        for i in range(5 if args.quick else 10):
            name = f"bench-bare-{tag}-{i}"
            spec = PodSpec(
                name=name,
                namespace=settings.namespace,
                installation="bench-bare",
                job="bench",
                sandbox_id=name,
                nonce=name,
                role="rollout",
                image=IMAGE,
                cpu_m=500,
                memory_b=256 << 20,
                token="x" * 32,
            )
            t0 = time.perf_counter()
            backend.create(spec)
            for _info in backend.watch_ready(settings.namespace, {name}, 30):
                break
            bare_create.append(time.perf_counter() - t0)
            backend.delete(settings.namespace, name, name)
        print()
        line("baseline: Redis PING", rtt)
        line("baseline: bare local create", bare_create, "(create -> execd answers)")

        # -- warm hits -----------------------------------------------------------------
        if "warm" in phases:
            counts = {1: 20, 10: 5, 100: 1} if not args.quick else {1: 10, 10: 2, 100: 1}
            size = 100
            warm_job = f"bench-warm-{tag}"
            cpu_m, mem = 250, 256 << 20
            with sessions.begin() as session:
                store.ensure_job(
                    session,
                    warm_job,
                    warm_pools=[
                        {
                            "image": IMAGE,
                            "cpu_m": cpu_m,
                            "memory_b": mem,
                            "size": size,
                            "idle_timeout_s": 600,
                        }
                    ],
                )
            key = pool_key(IMAGE, None, None, cpu_m, mem)
            warm = WarmStore(client.redis)

            def fill() -> None:
                client.send(Task.POOL_UPKEEP, [], Queue.POOL)
                deadline = time.monotonic() + 120
                while warm.size(warm_job, key) < size and time.monotonic() < deadline:
                    time.sleep(0.1)

            for conc, per in counts.items():
                fill()
                held = run_threads(
                    conc,
                    per,
                    lambda: client.open(
                        image=IMAGE, cpu=f"{cpu_m}m", memory=mem, job=warm_job, timeout=60
                    ),
                )
                hits = [sb.acquire_s for sb in held if sb.lease.warm]
                line(
                    f"warm hit c={conc}",
                    hits,
                    f"vs Redis RTT p50 {ms(pct(rtt, 50)).strip()}; misses {len(held) - len(hits)}",
                )
                for sb in held:
                    sb.release()
            with sessions.begin() as session:
                store.ensure_job(session, warm_job, warm_pools=[])
            client.send(Task.POOL_UPKEEP, [], Queue.POOL)

        drained(f"bench-warm-{tag}")
        # -- cold acquires -----------------------------------------------------------
        if "cold" in phases:
            cold_job = f"bench-cold-{tag}"
            with sessions.begin() as session:
                store.ensure_job(session, cold_job)
            cold_counts = {1: 10, 10: 3, 100: 1} if not args.quick else {1: 5, 10: 1, 100: 1}
            for conc, per in cold_counts.items():
                held = run_threads(
                    conc,
                    per,
                    lambda: client.open(
                        image=IMAGE, cpu="500m", memory="256Mi", job=cold_job, timeout=300
                    ),
                )
                line(
                    f"cold acquire c={conc}",
                    [sb.acquire_s for sb in held],
                    f"vs bare create p50 {ms(pct(bare_create, 50)).strip()}",
                )
                for sb in held:
                    sb.release()
                time.sleep(1.0)

        drained(f"bench-cold-{tag}")
        # -- pacing accuracy ---------------------------------------------------------
        if "pace" in phases:
            rate, burst = args.pace_rate, args.pace_burst
            pace_job = f"bench-pace-{tag}"
            with sessions.begin() as session:
                store.ensure_job(session, pace_job, create_rate=rate, create_burst=burst)
            n = int(rate * args.duration + burst)
            requests = [
                acquire_request(IMAGE, "100m", "64Mi", pace_job, "bench", args.duration + 120)
                for _ in range(n)
            ]
            t0 = time.perf_counter()
            for request in requests:  # the whole burst is in the queue within milliseconds
                client.send(Task.ACQUIRE, [request], Queue.ACQUIRE)
            pending = list(requests)

            def paced() -> None:
                # Released at once: the phase measures creates, not how many pods fit here.
                client._wait(pending.pop()).release()

            run_threads(n, 1, paced)
            wall = time.perf_counter() - t0
            with sessions() as session:
                stamps = sorted(
                    r.creating_at.timestamp()
                    for r in session.scalars(select(Sandbox).where(Sandbox.job == pace_job))
                    if r.creating_at
                )
            span = stamps[-1] - stamps[0]
            achieved = achieved_rate(stamps, burst)
            worst, excess = pacing_windows(stamps, rate, burst)
            print(
                f"{'pacing accuracy':<28} {n} acquires enqueued at once, configured {rate:g}/s "
                f"burst {burst}: achieved {achieved:.3f}/s ({(achieved / rate - 1) * 100:+.2f}%) "
                f"over {span:.1f}s; max in any 1 s window {worst} (limit {rate + burst:g}); "
                f"worst excess over rate*t+burst {excess:+.2f} (creating_at stamps, DB latency "
                f"included); wall {wall:.1f}s"
            )
            time.sleep(1.0)

        drained(f"bench-pace-{tag}")
        # -- throughput with pacing off -------------------------------------------------
        if "throughput" in phases:
            tp_job = f"bench-tp-{tag}"
            with sessions.begin() as session:
                store.ensure_job(session, tp_job)
            stop_at = time.monotonic() + args.throughput_s
            done: list[float] = []
            lock = threading.Lock()

            def loop() -> None:
                while time.monotonic() < stop_at:
                    t1 = time.perf_counter()
                    with client.acquire(
                        image=IMAGE, cpu="100m", memory="64Mi", job=tp_job, timeout=120
                    ) as sb:
                        sb.exec("true")
                    with lock:
                        done.append(time.perf_counter() - t1)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=loop) for _ in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            line(
                "acquire+exec+release c=16",
                done,
                f"throughput {len(done) / elapsed:.1f}/s (pacing off, cold creates)",
            )
        return 0
    finally:
        client.close()
        drained(f"bench-%-{tag}", timeout=60)
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
