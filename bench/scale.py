"""Scale run: hold 12,000+ sandboxes on the local cluster's kwok nodes through the full stack.

    .venv/bin/python bench/scale.py [--target 12000] [--rate 40] [--burst 40]

Full stack: trainer client -> Redis queue -> Celery acquire worker(s) -> shared pacer
(Redis) -> ledger (PostgreSQL) -> kube-apiserver -> kwok fake nodes. **Readiness is
simulated**: kwok pods have no containers, so no execd answers; for jobs whose
node_selector is ``type=kwok`` the provider takes the pod's Ready condition (set by kwok) as
ready and skips the authenticated execd poll (rows are marked ``readiness_simulated``).

Phases: bare API create-rate baseline (plain client, no broker) -> ramp (acquires offered at
the pacer's rate, progress every 5 s) -> one GC pass at full scale (timed) -> release all ->
leak check (GC pass, ledger, cluster) -> cleanup. Writes bench/out/scale.json, read by
bench/report.py. Uses its own installation id, namespace, state dir and service ports.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
sys.path.insert(0, str(REPO))

KWOK_SELECTOR = {"type": "kwok"}
KWOK_TOLERATIONS = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
IMAGE = "localhost/sandman-task-base:v1"
CPU, MEMORY = "10m", "16Mi"  # the validation minimum: kwok node capacity is the limit


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values) if values else math.nan,
    }


# -- process accounting -------------------------------------------------------------------


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


def cluster_pids() -> dict[str, list[int]]:
    state = Path(
        os.environ.get("SANDMAN_CLUSTER_STATE", Path.home() / ".local/state/sandman/cluster")
    )
    out: dict[str, list[int]] = {}
    for comp in ("kube-apiserver", "etcd", "kwok", "kube-scheduler", "kube-controller-manager"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[comp] = [int((state / "pids" / f"{comp}.pid").read_text().split()[0])]
    return out


# -- environment ------------------------------------------------------------------------------


def scale_env(args: argparse.Namespace, kubeconfig: str, tag: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SANDMAN_STATE_DIR=str(OUT / "state-kube"),
        SANDMAN_EMBEDDED_PG_PORT="25442",
        SANDMAN_EMBEDDED_REDIS_PORT="26389",
        SANDMAN_DATABASE_URL="",
        SANDMAN_REDIS_URL="",
        SANDMAN_BACKEND="kubernetes",
        SANDMAN_KUBECONFIG=kubeconfig,
        SANDMAN_NAMESPACE=f"sandman-{tag}",
        SANDMAN_INSTALLATION_ID=f"sandman-{tag}",
        SANDMAN_CREATE_RATE=str(args.rate),
        SANDMAN_CREATE_BURST=str(args.burst),
        SANDMAN_MAX_CONCURRENT_CREATES=str(args.max_concurrent),
        SANDMAN_GC_INTERVAL_S="3600",  # the bench runs one timed pass itself
        SANDMAN_LOG_LEVEL="WARNING",
    )
    return env


def kubeconfig_path() -> str:
    path = os.environ.get("SANDMAN_TEST_KUBECONFIG") or ""
    if path:
        return path
    out = subprocess.run(
        [str(REPO / "deploy/localcluster/up.sh")], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def bare_pod(name: str, namespace: str, tag: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"bench-bare": tag}},
        "spec": {
            "nodeSelector": KWOK_SELECTOR,
            "tolerations": KWOK_TOLERATIONS,
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "resources": {
                        "requests": {"cpu": CPU, "memory": MEMORY},
                        "limits": {"cpu": CPU, "memory": MEMORY},
                    },
                }
            ],
        },
    }


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


# -- the run --------------------------------------------------------------------------------------


class Harness:
    """A stack with the kubernetes backend, a client, and helpers shared with burst.py."""

    def __init__(self, args: argparse.Namespace, tag: str) -> None:
        self.args = args
        self.tag = tag
        self.kubeconfig = kubeconfig_path()
        self.env = scale_env(args, self.kubeconfig, tag)
        os.environ.update(self.env)
        from broker.backends.kube.api import Kube, load_api_client
        from broker.client.sync import SandboxClient
        from broker.ledger.db import make_engine, make_session_factory
        from broker.local.stack import Stack
        from broker.settings import Settings

        self.settings = Settings.from_env()
        self.kube = Kube(load_api_client(self.kubeconfig, qps_pool=128))
        self.kube.ensure_namespace(self.settings.namespace)
        self.stack = Stack(self.settings)
        self.stack.start(web=False, echo=False)
        self.extra: list[subprocess.Popen[bytes]] = []
        from broker.local.stack import child_env, worker_argv

        extra = [("acquire", 48)] * args.extra_acquire_workers
        extra += [("release", 32)] * getattr(args, "extra_release_workers", 0)
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
        from broker.ledger import store

        self.job = f"scale-{tag}"
        with self.sessions.begin() as session:
            store.ensure_job(
                session,
                self.job,
                node_selector=KWOK_SELECTOR,
                tolerations=KWOK_TOLERATIONS,
                lease_s=86400.0,  # held without heartbeats: 12k heartbeat threads would not fit
                readiness_budget_s=300.0,
            )
        time.sleep(2)
        pids = {
            "broker": [p.pid for p in self.stack.procs.values()] + [p.pid for p in self.extra],
            "bench_client": [os.getpid()],
        }
        pids.update(cluster_pids())
        self.meter = Meter(pids)

    def request(self, timeout: float) -> dict[str, Any]:
        from broker.wire.request import request_body

        return request_body(
            image=IMAGE,
            cpu=CPU,
            memory=MEMORY,
            job=self.job,
            role="rollout",
            image_digest=None,
            base_commit=None,
            workdir="/",
            env=None,
            owner=self.client.owner,
            timeout=timeout,
        )

    def offer(self, n: int, rate: float | None, timeout: float, on_progress: Any) -> dict[str, Any]:
        """Submit n acquires (at ``rate``/s, or all at once), collect every lease."""
        todo: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        held: list[Any] = []
        errors: list[str] = []
        lat: list[float] = []
        lock = threading.Lock()
        submitted = [0]

        def waiter() -> None:
            while (req := todo.get()) is not None:
                try:
                    sb = self.client._wait(req)
                except Exception as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with lock:
                    held.append(sb)
                    lat.append(sb.acquire_s)

        waiters = [threading.Thread(target=waiter, daemon=True) for _ in range(self.args.waiters)]
        for w in waiters:
            w.start()
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
            self.client.send("sandman.acquire", [req], "acquire")
            todo.put(req)
            submitted[0] += 1
            on_progress(submitted[0], len(held), len(errors), t0)
        submit_s = time.monotonic() - t0
        for _ in waiters:
            todo.put(None)
        while any(w.is_alive() for w in waiters):
            on_progress(submitted[0], len(held), len(errors), t0)
            time.sleep(0.5)
        return {
            "held": held,
            "errors": errors,
            "client_acquire_s": lat,
            "submit_s": submit_s,
            "wall_s": time.monotonic() - t0,
        }

    def progress_printer(self, label: str, series: list[dict[str, Any]]) -> Any:
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

    def release_all(self, held: list[Any], label: str, series: list[dict[str, Any]]) -> float:
        from sqlalchemy import func, select

        from broker.ledger.models import Sandbox

        t0 = time.monotonic()
        for sb in held:
            sb.release()
        tick = self.progress_printer(label, series)
        while True:
            with self.sessions() as session:
                live = (
                    session.scalar(
                        select(func.count())
                        .select_from(Sandbox)
                        .where(Sandbox.job == self.job, Sandbox.state != "deleted")
                    )
                    or 0
                )
            tick(len(held), int(live), 0, t0)
            if live == 0 or time.monotonic() - t0 > self.args.release_timeout:
                return time.monotonic() - t0
            time.sleep(1.0)

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
                select(func.count())
                .select_from(Sandbox)
                .where(Sandbox.state.in_(("requested", "creating", "ready", "releasing")))
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
        from broker.local.services import stop_postgres, stop_redis

        stop_postgres(self.settings)
        stop_redis(self.settings)
        if not self.args.keep_namespace:
            with contextlib.suppress(Exception):
                self.kube.delete_namespace(self.settings.namespace)


def rate_series(stamps: list[float], t0: float, bucket: float = 5.0) -> list[tuple[float, float]]:
    if not stamps:
        return []
    end = max(stamps)
    counts = [0] * (int((end - t0) / bucket) + 1)
    for s in stamps:
        if s >= t0:
            counts[int((s - t0) / bucket)] += 1
    return [(i * bucket, c / bucket) for i, c in enumerate(counts)]


def achieved_rate(stamps: list[float], burst: int) -> float:
    stamps = sorted(stamps)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return (len(stamps) - burst) / span if span > 0 else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=int, default=12000)
    parser.add_argument("--rate", type=float, default=40.0, help="pacer rate (creates/s)")
    parser.add_argument("--burst", type=int, default=40)
    parser.add_argument("--offered", type=float, default=None, help="acquires/s (default: rate)")
    parser.add_argument("--max-concurrent", type=int, default=256)
    parser.add_argument("--waiters", type=int, default=256)
    parser.add_argument("--extra-acquire-workers", type=int, default=0)
    parser.add_argument("--extra-release-workers", type=int, default=0)
    parser.add_argument("--bare-n", type=int, default=1000)
    parser.add_argument("--release-timeout", type=float, default=1800)
    parser.add_argument("--max-ramp-s", type=float, default=3600, help="ramp deadline")
    parser.add_argument("--keep-namespace", action="store_true")
    args = parser.parse_args()
    tag = f"scale-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    print(
        f"scale run {tag}: target {args.target}, pacer {args.rate}/s burst {args.burst}", flush=True
    )
    h = Harness(args, tag)
    doc: dict[str, Any] = {
        "tag": tag,
        "args": vars(args),
        "readiness": "SIMULATED (kwok: no execd poll)",
    }
    series: list[dict[str, Any]] = []
    try:
        print("bare API baseline ...", flush=True)
        doc["bare_api"] = bare_baseline(h.kube, h.settings.namespace, args.bare_n, 32, tag)
        print(f"bare API: {doc['bare_api']['create_rate']:.1f} creates/s", flush=True)
        h.meter = Meter(h.meter.groups)  # broker/apiserver usage over the ramp only
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
        stamps = [r["creating_at"] for r in rows if r["creating_at"]]
        ready = [r["ready_at"] for r in rows if r["ready_at"]]
        doc["create_to_ready_s"] = summary(
            [r["create_to_ready_s"] for r in rows if r["create_to_ready_s"] is not None]
        )
        doc["acquire_latency_s"] = summary(
            [r["acquire_latency_s"] for r in rows if r["acquire_latency_s"] is not None]
        )
        doc["achieved_create_rate"] = achieved_rate(stamps, args.burst)
        doc["pacer_rate"] = args.rate
        doc["create_rate_series"] = rate_series(stamps, ramp_t0)
        doc["live_series"] = [(p["t"], p["live"]) for p in series]
        doc["ready_series"] = rate_series(ready, ramp_t0)
        doc["hist_create_to_ready"] = [
            r["create_to_ready_s"] for r in rows if r["create_to_ready_s"] is not None
        ]
        doc["hist_acquire"] = [
            r["acquire_latency_s"] for r in rows if r["acquire_latency_s"] is not None
        ]
        doc["simulated_rows"] = sum(1 for r in rows if r["simulated"])
        doc["api_outcomes"] = h.api_outcomes()
        doc["progress"] = series
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "scale.json").write_text(json.dumps(doc, indent=1, default=str))
        print("releasing all ...", flush=True)
        rel_series: list[dict[str, Any]] = []
        doc["release_wall_s"] = h.release_all(got["held"], "release", rel_series)
        doc["release_rate"] = len(got["held"]) / doc["release_wall_s"]
        doc["usage_total"] = h.meter.totals()
        doc["leaks_after"] = h.leaks()
        doc["ledger"] = h.ledger_size()
        print(f"after teardown: {doc['leaks_after']}", flush=True)
        (OUT / "scale.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {OUT / 'scale.json'}", flush=True)
    finally:
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
