"""The full stack on the local cluster's kwok nodes, shared by the scale, burst and cold runs.

trainer client -> Redis queue -> Celery acquire worker(s) -> shared pacer (Redis) ->
ledger (PostgreSQL) -> kube-apiserver -> kwok fake nodes. **Readiness is simulated**:
kwok pods have no containers, so no execd answers; for jobs whose node_selector is
``type=kwok`` the provider takes the pod's Ready condition (set by kwok) as ready and
skips the authenticated execd poll (rows are marked ``readiness_simulated``).

Each run uses its own installation id, namespace, state dir and service ports, so it
never touches a ``sandman up`` or another bench. The flags every such run takes (pacer,
workers, waiters, teardown) are added by :func:`stack_arguments`, once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from bench.common import OUT, REPO, acquire_request, bench_env, kubeconfig_path, stop_services
from bench.kwok import ensure_kwok_job
from bench.meter import FLAT, Meter, cluster_pids, service_pids
from broker.names import Queue, Task

IMAGE = "localhost/sandman-task-base:v1"
CPU, MEMORY = "10m", "16Mi"  # the validation minimum: kwok node capacity is the limit
LIVE = ("requested", "creating", "ready", "releasing")

Progress = Callable[[int, int, int, float], None]


def stack_arguments(
    parser: argparse.ArgumentParser,
    *,
    rate: float,
    burst: int,
    waiters: int,
    release_timeout: float,
    extra_acquire_workers: int = 0,
) -> argparse.ArgumentParser:
    """The flags of every kwok-stack run, with that run's defaults."""
    parser.add_argument("--rate", type=float, default=rate, help="pacer rate (creates/s)")
    parser.add_argument("--burst", type=int, default=burst)
    parser.add_argument("--max-concurrent", type=int, default=256)
    parser.add_argument("--waiters", type=int, default=waiters)
    parser.add_argument("--extra-acquire-workers", type=int, default=extra_acquire_workers)
    parser.add_argument("--extra-release-workers", type=int, default=0)
    parser.add_argument(
        "--extra-pool-workers", type=int, default=0, help="64-thread workers for warm refills"
    )
    parser.add_argument("--release-timeout", type=float, default=release_timeout)
    parser.add_argument("--keep-namespace", action="store_true")
    return parser


def stack_env(args: argparse.Namespace, kubeconfig: str, tag: str) -> dict[str, str]:
    return bench_env(
        OUT / "state-kube",
        pg_port=25442,
        redis_port=26389,
        backend="kubernetes",
        installation=f"sandman-{tag}",
        SANDMAN_KUBECONFIG=kubeconfig,
        SANDMAN_NAMESPACE=f"sandman-{tag}",
        SANDMAN_CREATE_RATE=str(args.rate),
        SANDMAN_CREATE_BURST=str(args.burst),
        SANDMAN_MAX_CONCURRENT_CREATES=str(args.max_concurrent),
        SANDMAN_GC_INTERVAL_S="3600",  # the bench runs one timed pass itself
        SANDMAN_LOG_LEVEL="WARNING",
    )


def column(rows: list[dict[str, Any]], key: str) -> list[Any]:
    """The measured values of one ledger column (rows still being created have none)."""
    return [r[key] for r in rows if r[key] is not None]


@dataclass
class Collected:
    """Leases and errors of acquires being waited for by a pool of waiter threads."""

    held: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)


class Harness:
    """A stack with the kubernetes backend, a client, and the ledger and cluster read-backs."""

    def __init__(self, args: argparse.Namespace, tag: str) -> None:
        self.args = args
        self.tag = tag
        self.kubeconfig = kubeconfig_path()
        self.env = stack_env(args, self.kubeconfig, tag)
        os.environ.update(self.env)
        from broker.backends.kube.api import Kube, load_api_client
        from broker.client.sync import SandboxClient
        from broker.ledger.db import make_engine, make_session_factory
        from broker.local.stack import Stack, child_env, worker_argv
        from broker.settings import Settings

        self.settings = Settings.from_env()
        self.kube = Kube(load_api_client(self.kubeconfig, qps_pool=128))
        self.kube.ensure_namespace(self.settings.namespace)
        self.stack = Stack(self.settings)
        self.stack.start(web=False, echo=False)
        self.extra: list[subprocess.Popen[bytes]] = []
        extra = [(Queue.ACQUIRE, 48)] * args.extra_acquire_workers
        extra += [(Queue.RELEASE, 32)] * getattr(args, "extra_release_workers", 0)
        extra += [(Queue.POOL, 64)] * getattr(args, "extra_pool_workers", 0)
        for i, (queue_name, threads) in enumerate(extra):
            log = (self.stack.logs / f"worker-{queue_name}-extra{i}.log").open("ab")
            argv = worker_argv(f"{queue_name}{i}", queue_name, threads, "WARNING")
            self.extra.append(
                subprocess.Popen(
                    argv,
                    env=child_env(self.settings, self.stack.database_url, self.stack.redis_url),
                    stdout=log,
                    stderr=log,
                    cwd=REPO,
                )
            )
        self.engine = make_engine(self.stack.database_url, pool_size=10)
        self.sessions = make_session_factory(self.engine)
        self.client = SandboxClient(self.stack.redis_url, owner=f"bench-{tag}", heartbeat_s=3600)
        self.job = f"scale-{tag}"
        with self.sessions.begin() as session:
            # Held without heartbeats (12k heartbeat threads would not fit): a day's lease.
            ensure_kwok_job(session, self.job, lease_s=86400.0, readiness_budget_s=300.0)
        time.sleep(2)
        pids = {
            "broker": [p.pid for p in self.stack.procs.values()] + [p.pid for p in self.extra],
            **service_pids(self.settings.state_dir),
            "bench_client": [os.getpid()],
        }
        pids.update(cluster_pids())
        self.meter = Meter(pids, flat=FLAT)

    def request(self, timeout: float) -> dict[str, Any]:
        return acquire_request(IMAGE, CPU, MEMORY, self.job, self.client.owner, timeout)

    def open(self, timeout: float = 300) -> Any:
        """One acquire of the smallest pod kwok accepts, through the trainer client."""
        return self.client.open(image=IMAGE, cpu=CPU, memory=MEMORY, job=self.job, timeout=timeout)

    def collect(self, todo: queue.SimpleQueue[dict[str, Any] | None], n: int) -> Collected:
        """Start ``n`` waiters that take sent requests from ``todo`` until they get a None."""
        got = Collected()
        lock = threading.Lock()

        def waiter() -> None:
            while (req := todo.get()) is not None:
                try:
                    sb = self.client._wait(req)
                except Exception as exc:
                    with lock:
                        got.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with lock:
                    got.held.append(sb)
                    got.latency_s.append(sb.acquire_s)

        got.threads = [threading.Thread(target=waiter, daemon=True) for _ in range(n)]
        for w in got.threads:
            w.start()
        return got

    def wait_collected(
        self, got: Collected, submitted: int, t0: float, on_progress: Progress
    ) -> None:
        """Report progress until every waiter has its answer."""
        while got.alive():
            on_progress(submitted, len(got.held), len(got.errors), t0)
            time.sleep(0.5)

    def offer(
        self, n: int, rate: float | None, timeout: float, on_progress: Progress
    ) -> dict[str, Any]:
        """Submit n acquires (at ``rate``/s, or all at once), collect every lease."""
        todo: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        got = self.collect(todo, self.args.waiters)
        submitted = 0
        t0 = time.monotonic()
        for i in range(n):
            if rate:
                time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            # Every request expires at the ramp's end (``timeout`` after its start): a
            # ramp the machine cannot finish ends with AcquireTimeouts, not a hung bench.
            left = t0 + timeout - time.monotonic()
            if left < 5:
                break
            req = self.request(left)
            self.client.send(Task.ACQUIRE, [req], Queue.ACQUIRE)
            todo.put(req)
            submitted += 1
            on_progress(submitted, len(got.held), len(got.errors), t0)
        submit_s = time.monotonic() - t0
        for _ in got.threads:
            todo.put(None)
        self.wait_collected(got, submitted, t0, on_progress)
        return {
            "held": got.held,
            "errors": got.errors,
            "client_acquire_s": got.latency_s,
            "submit_s": submit_s,
            "wall_s": time.monotonic() - t0,
        }

    def progress_printer(self, label: str, series: list[dict[str, Any]]) -> Progress:
        state = {"last": 0.0}

        def tick(submitted: int, held: int, errors: int, t0: float) -> None:
            now = time.monotonic()
            if now - state["last"] < 5.0:
                return
            state["last"] = now
            usage = self.meter.sample()
            point = {"t": now - t0, "submitted": submitted, "live": held, "errors": errors}
            point.update(usage)
            series.append(point)
            print(
                f"[{label} {now - t0:6.0f}s] submitted {submitted:6d} live {held:6d} "
                f"errors {errors:3d} | apiserver {usage.get('kube-apiserver_cpu_pct', 0):5.0f}% "
                f"etcd {usage.get('etcd_cpu_pct', 0):4.0f}% "
                f"broker {usage.get('broker_cpu_pct', 0):5.0f}% "
                f"| load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

        return tick

    def ledger_rows(self) -> list[dict[str, Any]]:
        from sqlalchemy import select

        from broker.ledger.models import Sandbox

        with self.sessions() as session:
            rows = session.execute(
                select(
                    Sandbox.creating_at,
                    Sandbox.ready_at,
                    Sandbox.create_to_ready_s,
                    Sandbox.acquire_latency_s,
                    Sandbox.readiness_simulated,
                    Sandbox.state,
                ).where(Sandbox.job == self.job)
            ).all()
        return [
            {
                "creating_at": r[0].timestamp() if r[0] else None,
                "ready_at": r[1].timestamp() if r[1] else None,
                "create_to_ready_s": r[2],
                "acquire_latency_s": r[3],
                "simulated": r[4],
                "state": str(getattr(r[5], "value", r[5])),
            }
            for r in rows
        ]

    def api_outcomes(self) -> dict[str, int]:
        from sqlalchemy import func, select

        from broker.ledger.models import Event

        with self.sessions() as session:
            rows = session.execute(
                select(Event.action, Event.outcome, func.count())
                .where(Event.kind == "api", Event.job == self.job)
                .group_by(Event.action, Event.outcome)
            ).all()
        return {f"{a}:{o}": int(c) for a, o, c in rows}

    def release_all(
        self,
        held: list[Any],
        label: str,
        series: list[dict[str, Any]],
        jobs: Collection[str] = (),
    ) -> float:
        """Release ``held``, then wait until no row of ``jobs`` (default: the run's own
        job) is short of deleted; the seconds that took."""
        from sqlalchemy import func, select

        from broker.ledger.models import Sandbox

        t0 = time.monotonic()
        for sb in held:
            sb.release()
        tick = self.progress_printer(label, series)
        watched = list(jobs or (self.job,))
        while True:
            with self.sessions() as session:
                live = (
                    session.scalar(
                        select(func.count())
                        .select_from(Sandbox)
                        .where(Sandbox.job.in_(watched), Sandbox.state != "deleted")
                    )
                    or 0
                )
            tick(len(held), int(live), 0, t0)
            if live == 0 or time.monotonic() - t0 > self.args.release_timeout:
                return time.monotonic() - t0
            time.sleep(1.0)

    def release_and_check(
        self, held: list[Any], doc: dict[str, Any], jobs: Collection[str] = ()
    ) -> None:
        """The end of every run: release all, then the leak check; figures into ``doc``.
        ``jobs``: the jobs whose rows must be deleted first (default: the run's own job).

        ``usage_total`` is taken before the leak check, whose GC pass is not the run's cost."""
        print("releasing all ...", flush=True)
        doc["release_wall_s"] = self.release_all(held, "release", [], jobs)
        doc["usage_total"] = self.meter.totals()
        doc["leaks_after"] = self.leaks()
        print(f"after teardown: {doc['leaks_after']}", flush=True)

    def gc_pass(self) -> dict[str, Any]:
        from broker.backends.kube.backend import KubeBackend
        from broker.ownership.gc import run_gc
        from broker.ownership.provider import Provider

        provider = Provider(self.settings, self.sessions, KubeBackend.from_settings(self.settings))
        report = run_gc(provider)
        return {
            "duration_s": report.duration_s,
            "pods_seen": report.pods_seen,
            "live_rows": report.live_rows,
            "actions": len(report.actions),
            "clean": report.clean,
        }

    def leaks(self) -> dict[str, Any]:
        from sqlalchemy import func, select

        from broker.ledger.models import Leak, Sandbox

        gc = self.gc_pass()
        pods, _ = self.kube.list_pods(self.settings.namespace, "")
        with self.sessions() as session:
            open_leaks = session.scalar(
                select(func.count()).select_from(Leak).where(Leak.resolved_at.is_(None))
            )
            rows_live = session.scalar(
                select(func.count()).select_from(Sandbox).where(Sandbox.state.in_(LIVE))
            )
        return {
            "pods_left": len(pods),
            "open_leaks": int(open_leaks or 0),
            "live_rows": int(rows_live or 0),
            "gc_after": gc,
        }

    def ledger_size(self) -> dict[str, Any]:
        from sqlalchemy import text

        with self.engine.connect() as conn:
            out: dict[str, Any] = {}
            for table in ("sandboxes", "events", "leaks"):
                out[table] = {
                    "rows": conn.execute(text(f"SELECT count(*) FROM {table}")).scalar(),
                    "bytes": conn.execute(
                        text(f"SELECT pg_total_relation_size('{table}')")
                    ).scalar(),
                }
            out["database_bytes"] = conn.execute(
                text("SELECT pg_database_size(current_database())")
            ).scalar()
        return out

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        for proc in self.extra:
            proc.terminate()
        for proc in self.extra:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            if proc.poll() is None:
                proc.kill()
        self.stack.stop()
        self.engine.dispose()
        stop_services(self.settings)
        if not self.args.keep_namespace:
            with contextlib.suppress(Exception):
                self.kube.delete_namespace(self.settings.namespace)
