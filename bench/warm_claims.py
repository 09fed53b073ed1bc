"""Warm claims from a pool of 5,000 kwok sandboxes: p50/p99 at concurrency 1, 100 and 1,000.

    flock /work/bench.lock .venv/bin/python bench/warm_claims.py [--pool 5000] [--rate 40]

Full stack on the local cluster's kwok nodes (bench/kube_stack.py): one job with a warm
pool of ``--pool`` members, built by the broker's own upkeep and paced refills, and a
second job with a pool of 50 (the baseline). **Readiness is simulated** as in the scale
run, and so is the claim's health check: kwok pods run no execd, so before each phase the
bench points the address of every published warm lease at one of ``--execds`` real execd
processes on 127.0.0.1 (their ``/healthz`` is what a claim asks).

One trainer process, the async client (``broker.client.aio``), ``client.open()`` per
claim: the atomic claim in Redis, the health check, the hand-out sent to a worker (off
the trainer's path). Per phase: the claim's Redis round trip alone and the whole
``open()``. Baselines measured in the same run with the same client: a Redis PING at the
same concurrency, and claims from the 50-member pool at concurrency 1. Before each phase
the pool is refilled to ``--pool``; claimed sandboxes are released after their phase.
``--profile`` profiles the trainer process during the 1,000-concurrent phase.

Teardown: both pools set to 0 (upkeep trims them), every held sandbox released, a GC
pass and leak check, then the namespace, services and state of this run are removed.
Writes bench/out/warm_claims.json.

``--trainer-only``: no cluster, no workers; a Redis of the bench's own, with ``--pool``
warm leases published into it as the broker would (``WarmStore.publish``), each pointing
at a local execd. What it measures is the trainer's side of the claim alone (the hand-out
messages are queued and never consumed). Writes bench/out/warm_claims_trainer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import datetime as dt
import io
import json
import os
import pstats
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, save, summary
from bench.kube_stack import CPU, IMAGE, MEMORY, Harness, stack_arguments
from bench.kwok import ensure_kwok_job

BASELINE_POOL = 50
# Points every published lease of one pool at a local execd (KEYS: lease hash; ARGV: the
# addresses). Bench-only, between phases: it reads the whole hash on purpose.
REPOINT_LUA = """
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  local lease = cjson.decode(all[i + 1])
  lease['address'] = ARGV[(n % #ARGV) + 1]
  redis.call('HSET', KEYS[1], all[i], cjson.encode(lease))
  n = n + 1
end
return n
"""


def pool_entry(size: int) -> dict[str, Any]:
    return {"image": IMAGE, "cpu": CPU, "memory": MEMORY, "size": size, "idle_timeout_s": 86400}


class Bench:
    """The run: pools, local execds, and the async trainer that claims from them.

    ``h`` is the kwok stack; without it (``--trainer-only``) the pools are published
    straight into Redis."""

    def __init__(self, redis_url: str, args: argparse.Namespace, h: Harness | None) -> None:
        import redis

        from broker.pools.store import WarmStore, pool_key
        from broker.wire.validation import parse_cpu, parse_memory

        self.h, self.args, self.redis_url = h, args, redis_url
        self.key = pool_key(IMAGE, None, None, parse_cpu(CPU), parse_memory(MEMORY))
        self.big = h.job if h else "warm-trainer-only"
        self.small = f"{self.big}-base"
        self.redis = redis.Redis.from_url(redis_url)
        self.warm = WarmStore(self.redis)
        self.repoint = self.redis.register_script(REPOINT_LUA)
        self.execds: list[Any] = []
        self.addresses: list[str] = []
        self.published = 0
        self.name = "warm_claims" if h else "warm_claims_trainer"

    def start_execds(self, n: int) -> None:
        """Real execd processes on loopback: what a claim's health check talks to."""
        import re
        import secrets
        import subprocess

        from bench.common import REPO

        for i in range(n):
            log = OUT / f"warm-claims-execd-{i}.log"
            work = OUT / f"warm-claims-execd-{i}"
            work.mkdir(parents=True, exist_ok=True)
            env = {"PATH": "/usr/bin:/bin", "SANDMAN_EXECD_TOKEN": secrets.token_hex(16)}
            argv = [sys.executable, "-m", "execd", "--listen", "127.0.0.1:0"]
            argv += ["--workdir", str(work)]
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
            self.execds.append(proc)
            deadline = time.monotonic() + 30
            while not (m := re.search(r"listening on [^ ]+:(\d+)", log.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"execd {i} did not start: {log.read_text()[-500:]}")
                time.sleep(0.1)
            self.addresses.append(f"127.0.0.1:{m.group(1)}")

    def set_pools(self, big: int, small: int) -> None:
        if self.h is None:
            return
        with self.h.sessions.begin() as session:
            for job, size in ((self.big, big), (self.small, small)):
                pools = [pool_entry(size)] if size else []
                ensure_kwok_job(
                    session, job, lease_s=86400.0, readiness_budget_s=300.0, warm_pools=pools
                )

    def publish(self, job: str, size: int) -> None:
        """``--trainer-only``: top the pool up to ``size`` leases, as the broker publishes."""
        from broker.wire.types import Lease

        while self.warm.size(job, self.key) < size:
            self.published += 1
            address = self.addresses[self.published % len(self.addresses)]
            lease = Lease(f"sb-{self.published}", f"pod-{self.published}", address, "t" * 32)
            self.warm.publish(job, self.key, dataclasses.replace(lease, job=job, warm=True))

    def fill(self, job: str, size: int, label: str) -> float:
        """Wait (bounded) until ``size`` members are published; the seconds it took."""
        t0 = time.monotonic()
        if self.h is None:
            self.publish(job, size)
            return time.monotonic() - t0
        last, had = t0, self.warm.size(job, self.key)
        while (have := self.warm.size(job, self.key)) < size:
            if time.monotonic() - t0 > self.args.fill_timeout:
                raise RuntimeError(
                    f"{label}: {have} of {size} warm after {self.args.fill_timeout} s"
                )
            if time.monotonic() - last >= 10:
                rate = (have - had) / (time.monotonic() - last)  # published per s, lately
                last, had = time.monotonic(), have
                print(
                    f"[{label} {last - t0:5.0f}s] warm {have:5d} / {size} ({rate:.1f}/s)",
                    flush=True,
                )
            time.sleep(1.0)
        n = self.repoint(keys=[self.warm._keys(job, self.key)[1]], args=self.addresses)
        print(
            f"[{label}] {have} warm after {time.monotonic() - t0:.0f} s ({n} repointed)", flush=True
        )
        return time.monotonic() - t0

    # -- the trainer ------------------------------------------------------------------

    async def phase(
        self, client: Any, job: str, conc: int, n: int, profile: bool = False
    ) -> dict[str, Any]:
        """``n`` claims by ``conc`` concurrent tasks; everything claimed is held, then
        released after the phase."""
        claim_s: list[float] = []
        real = client._claim

        async def timed(**kw: Any) -> Any:
            t = time.perf_counter()
            out = await real(**kw)
            claim_s.append(time.perf_counter() - t)
            return out

        client._claim = timed
        open_s: list[float] = []
        held: list[Any] = []
        errors: list[str] = []
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t = time.perf_counter()
                try:
                    sb = await client.open(image=IMAGE, cpu=CPU, memory=MEMORY, job=job, timeout=60)
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                open_s.append(time.perf_counter() - t)
                held.append(sb)

        prof = cProfile.Profile() if profile else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        await asyncio.gather(*(worker() for _ in range(conc)))
        if prof:
            prof.disable()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        client._claim = real
        warm = sum(1 for sb in held if sb.lease.warm)
        await asyncio.gather(*(sb.release() for sb in held))
        out = {
            "job": job,
            "concurrency": conc,
            "claims": n,
            "warm_hits": warm,
            "errors": len(errors),
            "error_sample": errors[:5],
            "open_s": summary(open_s),
            "claim_redis_s": summary(claim_s),
            "wall_s": wall,
            "claims_per_s": len(open_s) / wall if wall else 0.0,
            "trainer_cpu_ms_per_claim": 1000 * cpu / max(len(open_s), 1),
        }
        if prof:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            out["profile_top"] = text.getvalue().splitlines()[:60]
        return out

    async def pings(self, client: Any, conc: int, n: int) -> dict[str, Any]:
        """The baseline: a Redis PING round trip from the same client, same concurrency."""
        lat: list[float] = []
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t = time.perf_counter()
                await client.redis.ping()
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(conc)))
        return summary(lat)

    async def run(self, doc: dict[str, Any]) -> None:
        from broker.client.aio import AsyncSandboxClient

        async with AsyncSandboxClient(
            self.redis_url, owner="bench-warm-claims", heartbeat_s=3600, max_connections=512
        ) as client:
            await client.redis.ping()
            self.fill(self.small, BASELINE_POOL, "baseline pool")
            doc["baseline_pool50_c1"] = await self.phase(client, self.small, 1, 40)
            phases = []
            for conc, n in self.args.phases:
                doc.setdefault("fill_s", []).append(
                    self.fill(self.big, self.args.pool, f"pool c={conc}")
                )
                doc.setdefault("ping", {})[str(conc)] = await self.pings(client, conc, max(n, 200))
                result = await self.phase(
                    client, self.big, conc, n, profile=self.args.profile and conc >= 1000
                )
                result["pool_before"] = self.args.pool
                phases.append(result)
                print(
                    json.dumps({k: v for k, v in result.items() if k != "profile_top"}), flush=True
                )
                save(self.name, doc)
            doc["phases"] = phases


def table(doc: dict[str, Any]) -> str:
    base = doc["baseline_pool50_c1"]
    lines = [
        "| pool | concurrency | claims | open() p50 | open() p99 | claim RTT p50 | claim RTT p99 "
        "| PING p50 | PING p99 | claims/s | trainer CPU/claim |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(BASELINE_POOL, base, None)] + [
        (doc["args"]["pool"], p, doc["ping"][str(p["concurrency"])]) for p in doc["phases"]
    ]
    for pool, p, ping in rows:
        o, c = p["open_s"], p["claim_redis_s"]
        ping_txt = f"{ping['p50'] * 1e3:.2f} ms | {ping['p99'] * 1e3:.2f} ms" if ping else "- | -"
        lines.append(
            f"| {pool} | {p['concurrency']} | {p['claims']} | {o['p50'] * 1e3:.2f} ms | "
            f"{o['p99'] * 1e3:.2f} ms | {c['p50'] * 1e3:.2f} ms | {c['p99'] * 1e3:.2f} ms | "
            f"{ping_txt} | {p['claims_per_s']:.0f} | {p['trainer_cpu_ms_per_claim']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=5000)
    parser.add_argument("--execds", type=int, default=8)
    parser.add_argument("--fill-timeout", type=float, default=900.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trainer-only", action="store_true", help="no cluster: see above")
    parser.add_argument(
        "--phases",
        type=lambda s: [tuple(int(x) for x in p.split("x")) for p in s.split(",")],
        default=[(1, 200), (100, 1000), (1000, 1000)],
        help="CONCxCLAIMS,... (default 1x200,100x1000,1000x1000)",
    )
    stack_arguments(parser, rate=40.0, burst=40, waiters=1, release_timeout=900)
    args = parser.parse_args()
    tag = f"warm-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    print(f"warm claims {tag}: pool {args.pool}, pacer {args.rate}/s", flush=True)
    doc: dict[str, Any] = {
        "tag": tag,
        "args": vars(args),
        "readiness": "SIMULATED (kwok); health checks answered by local execds",
    }
    if args.trainer_only:
        doc["readiness"] = "no pods: leases published into Redis, health by local execds"
        return trainer_only(args, doc)
    with Harness(args, tag) as h:
        bench = Bench(h.stack.redis_url, args, h)
        try:
            bench.start_execds(args.execds)
            bench.set_pools(args.pool, BASELINE_POOL)
            finish(bench, doc)
        finally:
            print("teardown: pools to 0, release, leak check ...", flush=True)
            with contextlib.suppress(Exception):
                bench.set_pools(0, 0)
            h.release_and_check([], doc)
            save("warm_claims", doc)
    return 0


def finish(bench: Bench, doc: dict[str, Any]) -> None:
    """Run the phases, print the table; the execds and the Redis client end here."""
    try:
        asyncio.run(bench.run(doc))
        doc["table"] = table(doc)
        print(doc["table"], flush=True)
    finally:
        for proc in bench.execds:
            proc.terminate()
        for proc in bench.execds:
            proc.wait(30)
        for path in OUT.glob("warm-claims-execd-*"):  # their workdirs and logs
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        save(bench.name, doc)
        bench.redis.close()


def trainer_only(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """The trainer's side alone, on a Redis of this run's own (stopped and removed after)."""
    from bench.common import bench_env, free_port
    from broker.local.services import ensure_redis, stop_redis
    from broker.settings import Settings

    state = OUT / "state-warm-trainer"
    env = bench_env(
        state, pg_port=free_port(), redis_port=free_port(), backend="local", installation=doc["tag"]
    )
    os.environ.update(env)
    settings = Settings.from_env()
    url = ensure_redis(settings)
    try:
        bench = Bench(url, args, None)
        bench.start_execds(args.execds)
        finish(bench, doc)
    finally:
        pidfile = state / "redis" / "redis.pid"
        pid = int(pidfile.read_text()) if pidfile.exists() else None
        stop_redis(settings)
        # Redis saves on its way out and refuses to exit if it cannot: the state dir goes
        # only once it is gone.
        deadline = time.monotonic() + 60
        while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
