"""System fault campaign: the whole stack under random faults, invariants checked throughout.

One run owns a complete stack instance: embedded PostgreSQL and Redis on their own ports
in a temporary state dir, Celery workers (acquire; release+pool) and beat as subprocesses,
the fault proxy in front of the local cluster's API server, and trainer subprocesses that
loop acquire -> hold -> release on kwok nodes (simulated readiness: kwok pods have no
containers, so the "rollout" is a hold of random length, not execd calls).

Faults, one at a time at random intervals (each kind once per round, in a random order;
after a worker restart the next fault waits until that worker is serving again):

  kill_worker     SIGKILL a Celery worker, restart it 1-3 s later
  kill_beat       SIGKILL beat, restart it
  restart_redis   SIGTERM Redis (append-only), start it again
  restart_pg      pg_ctl stop -m fast, start again
  api_blackout    "API server restart": the proxy cuts every open connection (watches
                  included) and drops every request for 2-5 s. The real API server is shared
                  by every other test, so it is not restarted; from the broker's side a
                  restart is exactly this: transport errors, then a fresh server.
  api_delay       1-2 s delay on a share of all API calls for a few seconds
  api_reset       resets / 500-after-store on a share of pod calls for a few seconds
  kill_trainer    SIGKILL a trainer mid-rollout (its sandboxes must come back via the GC)

Invariants (checked every second and at the end):

  hung acquires             an acquire neither answered nor errored by timeout + grace
  untyped errors            an acquire or release failing with anything but SandmanError
  duplicate hand-outs       one sandbox handed to two acquires (this job has no reuse)
  sentinel pods deleted     pods with our label keys that are not ours
  pods without one live row after recovery and one GC pass (and rows without a pod)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.sysstack import FAULT_KINDS, JOB, Config, Stack, wait_for
from bench.kwok import KWOK_IMAGE, ensure_kwok_job, plant_sentinels
from broker.names import Queue

__all__ = ["FAULT_KINDS", "Config", "Result", "run", "trainer_main"]
LIVE_STATES = ("requested", "creating", "ready", "releasing", "abandoned")


@dataclass
class Result:
    duration_s: float = 0.0
    trials: int = 0  # acquires issued by trainers
    answers: Counter[str] = field(default_factory=Counter)
    killed_mid_acquire: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    proxy_faults: dict[str, int] = field(default_factory=dict)
    violations: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "hung_acquires",
                "untyped_errors",
                "duplicate_handouts",
                "sentinels_deleted",
                "pods_without_one_live_row",
                "live_rows_without_pod",
                "gc_actions_pending",
                "secrets_in_logs_or_ledger",
            ),
            0,
        )
    )
    details: list[str] = field(default_factory=list)
    pods_created: int = 0
    gc_pass_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def summary(self) -> str:
        lines = [
            f"trials (acquires issued):        {self.trials}",
            f"answers:                         {dict(sorted(self.answers.items()))}",
            f"trainers killed mid-acquire:     {self.killed_mid_acquire}",
            f"pods created:                    {self.pods_created}",
            f"faults injected by kind:         {dict(sorted(self.faults.items()))}",
            f"proxy actions:                   {dict(sorted(self.proxy_faults.items()))}",
            "invariant violations:",
            *(f"  {k:<30} {v}" for k, v in self.violations.items()),
            f"wall time {self.duration_s:.1f}s (final GC pass {self.gc_pass_s:.2f}s)",
            "RESULT: " + ("OK" if self.ok else "INVARIANT VIOLATED"),
        ]
        if self.details:
            lines += ["details:", *("  " + d for d in self.details[:30])]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "duration_s": self.duration_s,
                "trials": self.trials,
                "answers": dict(self.answers),
                "killed_mid_acquire": self.killed_mid_acquire,
                "pods_created": self.pods_created,
                "faults": dict(self.faults),
                "proxy_faults": self.proxy_faults,
                "violations": self.violations,
                "details": self.details,
                "ok": self.ok,
            },
            indent=2,
        )


# -- trainer subprocess ----------------------------------------------------------------------


def trainer_main(out: str, redis_url: str, timeout: float, seed: int, stop: str) -> None:
    """Loop acquire -> hold -> release, one JSON line per event (flushed: we may be killed)."""
    from broker.client.sync import SandboxClient
    from broker.errors import SandmanError

    rng = random.Random(seed)
    client = SandboxClient(redis_url, owner=f"trainer-{os.getpid()}")
    with open(out, "a", buffering=1) as f:

        def rec(ev: str, n: int, **kw: Any) -> None:
            f.write(json.dumps({"ev": ev, "n": n, "t": time.time(), **kw}) + "\n")

        n = 0
        while not os.path.exists(stop):
            n += 1
            rec("start", n)
            try:
                sb = client.open(
                    image=KWOK_IMAGE, job=JOB, cpu="10m", memory="16Mi", timeout=timeout
                )
            except SandmanError as exc:
                rec("error", n, kind=type(exc).__name__)
                time.sleep(0.2)
                continue
            except Exception as exc:
                rec("untyped", n, kind=type(exc).__name__, msg=str(exc)[:300])
                time.sleep(0.2)
                continue
            rec("lease", n, sandbox=sb.lease.sandbox_id, pod=sb.lease.pod_name)
            time.sleep(rng.uniform(0.2, 1.5))  # the rollout
            try:
                sb.release()
                rec("released", n, sandbox=sb.lease.sandbox_id)
            except SandmanError as exc:
                rec("release_error", n, kind=type(exc).__name__, sandbox=sb.lease.sandbox_id)
            except Exception as exc:
                rec("untyped", n, kind=type(exc).__name__, msg=str(exc)[:300], where="release")
    client.close()


# -- invariants ------------------------------------------------------------------------------


def read_records(state_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for path in state_dir.glob("trainer-*.jsonl"):
        i = int(path.stem.split("-")[1])
        recs = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))  # a killed trainer may leave half a line
        out[i] = recs
    return out


def check_records(
    records: dict[int, list[dict[str, Any]]],
    killed: set[int],
    now: float,
    limit_s: float,
    result: Result | None = None,
) -> dict[str, list[str]]:
    """Hangs, untyped errors and duplicate hand-outs from the trainers' own records."""
    found: dict[str, list[str]] = {"hung": [], "untyped": [], "dup": []}
    holders: dict[str, str] = {}
    for i, recs in sorted(records.items()):
        pending: dict[int, float] = {}
        for r in recs:
            if r["ev"] == "start":
                pending[r["n"]] = r["t"]
                if result is not None:
                    result.trials += 1
            elif r["ev"] in ("lease", "error", "untyped") and r.get("where") != "release":
                pending.pop(r["n"], None)
                if result is not None:
                    result.answers["lease" if r["ev"] == "lease" else r.get("kind", "?")] += 1
            if r["ev"] == "untyped":
                found["untyped"].append(f"trainer {i} #{r['n']}: {r['kind']}: {r.get('msg')}")
            if r["ev"] == "lease":
                who = f"trainer {i} #{r['n']}"
                if r["sandbox"] in holders:
                    found["dup"].append(f"{r['sandbox']}: {holders[r['sandbox']]} and {who}")
                holders[r["sandbox"]] = who
        for n, t in pending.items():
            if i in killed:
                if result is not None:
                    result.killed_mid_acquire += 1
            elif now - t > limit_s:
                found["hung"].append(f"trainer {i} #{n}: no answer after {now - t:.0f}s")
    return found


def sentinel_names(admin: Any, namespace: str) -> set[str]:
    from broker.backends.kube.backend import KubeBackend

    pods = KubeBackend(admin, installation="-").list_all_labelled(namespace)
    return {p.name for p in pods if p.name.startswith("sentinel-")}


# -- the run ---------------------------------------------------------------------------------


def run(cfg: Config, progress: Callable[[str], None] = lambda s: None) -> Result:
    from bench.harness.faultproxy import FaultProxy, Rule
    from broker.backends.kube.api import Kube, load_api_client
    from broker.backends.kube.backend import KubeBackend
    from broker.ledger.db import make_engine, make_session_factory
    from broker.ownership.gc import run_gc
    from broker.ownership.provider import Provider

    rng = random.Random(cfg.seed)
    result = Result()
    t0 = time.monotonic()
    stack = Stack(cfg)
    admin = Kube(load_api_client(cfg.kubeconfig))
    admin.ensure_namespace(stack.namespace)
    proxy = FaultProxy.from_kubeconfig(cfg.kubeconfig, seed=cfg.seed).start()
    stack.proxy_kubeconfig = str(proxy.write_kubeconfig(cfg.state_dir / "proxy.kubeconfig"))
    engine = None
    try:
        progress("starting services")
        stack.start_services()
        engine = make_engine(stack.database_url, pool_size=2)
        sessions = make_session_factory(engine)
        with sessions.begin() as s:
            ensure_kwok_job(s, JOB, readiness_budget_s=cfg.readiness_budget_s, lease_s=cfg.lease_s)
        sentinels = set(plant_sentinels(admin, stack.namespace, stack.installation, cfg.sentinels))
        for name in ("worker-acquire", "worker-control", "beat"):
            stack.spawn(name)
        stack.wait_ready("worker-acquire")
        stack.wait_ready("worker-control")
        for _ in range(cfg.trainers):
            stack.spawn_trainer()
        progress(f"workload running ({cfg.trainers} trainers) for {cfg.duration_s:.0f}s")

        stop = threading.Event()
        limit = cfg.acquire_timeout_s + cfg.hang_grace_s
        seen: dict[str, set[str]] = {"hung": set(), "untyped": set(), "dup": set()}
        sentinel_lost: set[str] = set()

        def monitor() -> None:
            while not stop.wait(1.0):
                found = check_records(
                    read_records(cfg.state_dir), stack.killed_trainers, time.time(), limit
                )
                for k, v in found.items():
                    seen[k].update(v)
                with contextlib.suppress(Exception):  # the API may be slow; the end check counts
                    sentinel_lost.update(sentinels - sentinel_names(admin, stack.namespace))

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        end = time.monotonic() + cfg.duration_s
        order: list[str] = []
        while time.monotonic() < end:
            time.sleep(rng.uniform(*cfg.fault_gap_s))
            if time.monotonic() >= end:
                break
            if not order:  # every kind once per round, in a random order
                order = rng.sample(list(cfg.kinds), len(cfg.kinds))
            kind = order.pop()
            progress(f"fault {kind}")
            inject(kind, stack, proxy, rng, Rule)
            result.faults[kind] += 1
        proxy.clear()
        result.proxy_faults = dict(proxy.counts)

        progress("stopping trainers")
        stack.stop_file.touch()
        deadline = time.monotonic() + limit + 5
        for i, proc in stack.trainers.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result.details.append(f"trainer {i} did not stop: killed")
                seen["hung"].add(f"trainer {i} did not finish after stop")
                proc.kill()
                proc.wait()
        stop.set()
        watcher.join()
        found = check_records(
            read_records(cfg.state_dir), stack.killed_trainers, time.time(), limit, result
        )
        for k, v in found.items():
            seen[k].update(v)

        progress("recovery: waiting for queues and leases")
        _recover(stack, sessions, cfg)
        stack.stop_all()
        progress("one GC pass")
        gc_settings = stack.settings.__class__(
            **{**stack.settings.__dict__, "kubeconfig": cfg.kubeconfig}
        )
        provider = Provider(
            gc_settings, sessions, KubeBackend.from_settings(gc_settings), actor="gc"
        )
        report = run_gc(provider)
        result.gc_pass_s = report.duration_s
        after = run_gc(provider, dry_run=True)
        result.violations["gc_actions_pending"] = len(after.actions)
        result.details += [f"pending after GC: {a}" for a in after.actions]
        _final_ownership(stack, admin, sessions, result)
        leaks = scan_secrets(stack, sessions)
        result.violations["secrets_in_logs_or_ledger"] = len(leaks)
        result.details += leaks
        sentinel_lost.update(sentinels - sentinel_names(admin, stack.namespace))
        result.violations["hung_acquires"] = len(seen["hung"])
        result.violations["untyped_errors"] = len(seen["untyped"])
        result.violations["duplicate_handouts"] = len(seen["dup"])
        result.violations["sentinels_deleted"] = len(sentinel_lost)
        for k in ("hung", "untyped", "dup"):
            result.details += sorted(seen[k])
        result.details += [f"sentinel deleted: {n}" for n in sorted(sentinel_lost)]
    finally:
        stack.stop_all()
        with contextlib.suppress(Exception):
            proxy.stop()
        if engine is not None:
            engine.dispose()
        stack.stop_services()
        with contextlib.suppress(Exception):
            admin.delete_namespace(stack.namespace)
    result.duration_s = time.monotonic() - t0
    return result


def inject(kind: str, stack: Stack, proxy: Any, rng: random.Random, rule: Any) -> None:
    if kind == "kill_worker":
        name = rng.choice(["worker-acquire", "worker-control"])
        stack.kill(name)
        time.sleep(rng.uniform(1, 3))
        stack.spawn(name)
        # The next fault waits until this worker serves again: on a loaded machine a
        # restart takes long enough that back-to-back kills would only measure an outage.
        stack.wait_ready(name)
    elif kind == "kill_beat":
        stack.kill("beat")
        time.sleep(rng.uniform(0.5, 2))
        stack.spawn("beat")
    elif kind == "restart_redis":
        stack.restart_redis()
    elif kind == "restart_pg":
        stack.restart_pg()
    elif kind == "api_blackout":
        seconds = rng.uniform(2, 5)
        proxy.blackout(seconds)
        time.sleep(seconds)
    elif kind in ("api_delay", "api_reset"):
        if kind == "api_delay":
            rules = [rule("delay", "*", r".*", probability=0.3, times=None, seconds=1.5)]
        else:
            rules = [
                rule("reset_after", "POST", r"/pods$", probability=0.2, times=None),
                rule("error_after", "POST", r"/pods$", probability=0.1, times=None),
                rule("reset_before", "*", r"/pods", probability=0.1, times=None),
                rule("reset_after", "DELETE", r"/pods/[^/]+$", probability=0.2, times=None),
            ]
        for r in rules:
            proxy.add(r)
        time.sleep(rng.uniform(2, 5))
        proxy.clear()
    elif kind == "kill_trainer":
        alive = [i for i, p in stack.trainers.items() if p.poll() is None]
        if alive:
            victim = rng.choice(alive)
            stack.trainers[victim].send_signal(signal.SIGKILL)
            stack.trainers[victim].wait()
            stack.killed_trainers.add(victim)
            stack.spawn_trainer()


def _live() -> list[Any]:
    from broker.ledger.states import State

    return [State(v) for v in LIVE_STATES]


def _recover(stack: Stack, sessions: Any, cfg: Config) -> None:
    """Let the queues drain, then wait until every live row's lease has run out."""
    import datetime as dt

    import redis
    from sqlalchemy import func, select

    from broker.ledger.models import Sandbox

    r = redis.Redis.from_url(stack.redis_url)
    with contextlib.suppress(TimeoutError):
        wait_for(
            lambda: r.llen(Queue.ACQUIRE) == 0 and r.llen(Queue.RELEASE) == 0, 60, "queues drained"
        )
    r.close()
    cap = time.monotonic() + max(cfg.lease_s, cfg.readiness_budget_s) + 40
    while time.monotonic() < cap:
        with sessions() as s:
            latest = s.scalar(
                select(func.max(Sandbox.lease_expires_at)).where(Sandbox.state.in_(_live()))
            )
        if latest is None or latest < dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1):
            return
        time.sleep(1)


def scan_secrets(stack: Stack, sessions: Any) -> list[str]:
    """Every execd token, the service passwords and the broker key: in no log, no ledger cell."""
    from sqlalchemy import select, text

    from broker.ledger.base import Base
    from broker.ledger.models import Sandbox
    from broker.ownership.tokens import broker_key, derive_token

    key = broker_key(stack.settings)
    with sessions() as s:
        ids = s.execute(select(Sandbox.id, Sandbox.nonce)).all()
    needles = {f"token of {i}": derive_token(key, i, n) for i, n in ids}
    for f in (stack.cfg.state_dir / "secrets").glob("*"):
        needles[f"secret file {f.name}"] = f.read_text().strip()
    needles["broker key"] = key.decode(errors="replace")
    needles = {k: v for k, v in needles.items() if len(v) >= 8}
    found: list[str] = []
    files = [p for p in stack.cfg.state_dir.rglob("*") if p.is_file() and _is_log(p)]
    for path in files:
        data = path.read_bytes().decode(errors="replace")
        found += [f"{what} in {path.name}" for what, v in needles.items() if v in data]
    with sessions() as s:
        for table in Base.metadata.sorted_tables:
            sql = f'SELECT t::text FROM "{table.name}" t'
            rows = s.execute(text(sql)).scalars().all()
            blob = "\n".join(rows)
            found += [
                f"{what} in ledger table {table.name}" for what, v in needles.items() if v in blob
            ]
    return found


def _is_log(path: Path) -> bool:
    return path.suffix in (".log", ".jsonl") or "log" in path.parent.name


def _final_ownership(stack: Stack, admin: Any, sessions: Any, result: Result) -> None:
    from sqlalchemy import func, select

    from broker.backends.base import LABEL_NONCE
    from broker.backends.kube.backend import KubeBackend
    from broker.ledger.models import Event, Sandbox

    pods = KubeBackend(admin, installation=stack.installation).list_installation(
        stack.namespace, stack.installation
    )
    with sessions() as s:
        rows = s.execute(
            select(Sandbox.nonce, Sandbox.pod_name).where(
                Sandbox.installation == stack.installation, Sandbox.state.in_(_live())
            )
        ).all()
        result.pods_created = int(
            s.scalar(
                select(func.count(func.distinct(Event.pod_name))).where(
                    Event.kind == "api",
                    Event.action.in_(["create", "adopt"]),
                    Event.outcome.in_(["created", "nonce-match"]),
                )
            )
            or 0
        )
    by_nonce = Counter(n for n, _ in rows)
    for pod in pods:
        if pod.name.startswith("sentinel-"):
            continue  # not ours by nonce: counted by the sentinel invariant
        if by_nonce.get(pod.labels.get(LABEL_NONCE, ""), 0) != 1:
            result.violations["pods_without_one_live_row"] += 1
            result.details.append(
                f"pod {pod.name} has {by_nonce.get(pod.labels.get(LABEL_NONCE, ''), 0)} live rows"
            )
    pod_nonces = {p.labels.get(LABEL_NONCE) for p in pods}
    for nonce, name in rows:
        if nonce not in pod_nonces:
            result.violations["live_rows_without_pod"] += 1
            result.details.append(f"live row {name} has no pod")


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        out, url, timeout, seed, stop_path = sys.argv[2:7]
        trainer_main(out, url, float(timeout), int(seed), stop_path)
