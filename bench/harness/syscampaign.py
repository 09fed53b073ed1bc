"""System fault campaign: the whole stack under random faults, invariants checked throughout.

One run owns a complete stack instance: embedded PostgreSQL and Redis on their own ports
in a temporary state dir, Celery workers (acquire; release+pool) and beat as subprocesses,
and trainer subprocesses that loop acquire -> hold -> release. Where the sandboxes live
is a "world" (bench/harness/sysworld.py): kwok pods on the local cluster behind the fault
proxy (simulated readiness: kwok pods have no containers, so the "rollout" is a hold of
random length), or, with ``--backend local``, bubblewrap sandboxes on this machine whose
rollout also runs a command through the real execd.

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
  crash_at_failpoint
                  restart a worker with SANDMAN_FAILPOINT=<point>, each in turn (broker/
                  failpoints.py: creates on the acquire worker, releases on the control
                  worker; after-sandbox-start on the local backend, between the sandbox
                  process start and its creator's bookkeeping; after-uplink-start, with
                  the sandbox's egress uplink running), let it die there, restart it
  flood_execd     local backend: 300 token-less connections (half idle, half slow-loris,
                  each one the server cuts replaced at once) held against the live
                  sandboxes' execd for 8-15 s (bench/harness/execdflood.py)

Invariants (checked every second and at the end):

  hung acquires             an acquire neither answered nor errored by timeout + grace
  untyped errors            an acquire or release failing with anything but SandmanError
  duplicate hand-outs       one sandbox handed to two acquires (this job has no reuse)
  sentinel pods deleted     pods with our label keys that are not ours
  pods without one live row after recovery and one GC pass (and rows without a pod),
                            pods judged by the world's independent count (the cluster read
                            directly; on the local backend the kernel's process list)
  audit not OK              ``sandman audit`` after that GC pass: unowned or late pods,
                            dangling rows
  audit vs independent count  the audit's pods differ from the world's own count
  execd flood call failures   a trainer's call to its execd that failed (SandboxLost or
                            any other error) during a flood_execd window (or 2 s after)
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
from bench.harness.sysworld import RELEASE_POINTS, make_world
from bench.kwok import KWOK_IMAGE
from broker import failpoints
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
                "audit_not_ok",
                "audit_vs_independent_count",
                "execd_flood_call_failures",
            ),
            0,
        )
    )
    details: list[str] = field(default_factory=list)
    pods_created: int = 0
    gc_pass_s: float = 0.0
    failpoint_crashes: Counter[str] = field(default_factory=Counter)
    audit_pods: int = 0
    independent_pods: int = 0
    flood_windows: list[tuple[float, float]] = field(default_factory=list)
    flood_stats: Counter[str] = field(default_factory=Counter)  # what the flood's sockets saw
    flood_calls: Counter[str] = field(default_factory=Counter)  # trainer calls in a window

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
            f"worker exits at failpoints:      {dict(sorted(self.failpoint_crashes.items()))}",
            f"final audit vs own count:        {self.audit_pods} vs {self.independent_pods}",
            f"execd floods (s; sockets):       {self._flood_seconds():.0f}; "
            f"{dict(sorted(self.flood_stats.items()))}",
            f"trainer calls during floods:     {dict(sorted(self.flood_calls.items()))}",
            f"proxy actions:                   {dict(sorted(self.proxy_faults.items()))}",
            "invariant violations:",
            *(f"  {k:<30} {v}" for k, v in self.violations.items()),
            f"wall time {self.duration_s:.1f}s (final GC pass {self.gc_pass_s:.2f}s)",
            "RESULT: " + ("OK" if self.ok else "INVARIANT VIOLATED"),
        ]
        if self.details:
            lines += ["details:", *("  " + d for d in self.details[:30])]
        return "\n".join(lines)

    def _flood_seconds(self) -> float:
        return sum(end - start for start, end in self.flood_windows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "duration_s": self.duration_s,
                "trials": self.trials,
                "answers": dict(self.answers),
                "killed_mid_acquire": self.killed_mid_acquire,
                "pods_created": self.pods_created,
                "faults": dict(self.faults),
                "failpoint_crashes": dict(self.failpoint_crashes),
                "audit_pods": self.audit_pods,
                "independent_pods": self.independent_pods,
                "flood_s": self._flood_seconds(),
                "flood_stats": dict(self.flood_stats),
                "flood_calls": dict(self.flood_calls),
                "proxy_faults": self.proxy_faults,
                "violations": self.violations,
                "details": self.details,
                "ok": self.ok,
            },
            indent=2,
        )


# -- trainer subprocess ----------------------------------------------------------------------


def trainer_main(
    out: str, redis_url: str, timeout: float, seed: int, stop: str, image: str = KWOK_IMAGE
) -> None:
    """Loop acquire -> hold -> release, one JSON line per event (flushed: we may be killed).

    A sandbox with an execd (not kwok's) also runs one command during its hold."""
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
                sb = client.open(image=image, job=JOB, cpu="10m", memory="16Mi", timeout=timeout)
            except SandmanError as exc:
                rec("error", n, kind=type(exc).__name__)
                time.sleep(0.2)
                continue
            except Exception as exc:
                rec("untyped", n, kind=type(exc).__name__, msg=str(exc)[:300])
                time.sleep(0.2)
                continue
            rec("lease", n, sandbox=sb.lease.sandbox_id, pod=sb.lease.pod_name)
            if image != KWOK_IMAGE:
                try:
                    sb.exec(f"echo {n}")
                    rec("exec", n, sandbox=sb.lease.sandbox_id)
                except SandmanError as exc:
                    rec("exec_error", n, kind=type(exc).__name__, sandbox=sb.lease.sandbox_id)
                except Exception as exc:
                    rec("untyped", n, kind=type(exc).__name__, msg=str(exc)[:300], where="exec")
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
            elif r["ev"] in ("lease", "error", "untyped") and r.get("where") not in (
                "release",
                "exec",
            ):
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


FLOOD_GRACE_S = 2.0  # a call that started in a flood may end just after it


def check_flood_calls(records: dict[int, list[dict[str, Any]]], result: Result) -> None:
    """Trainer calls to execd answered, or failed, while a flood_execd fault ran: every
    one must be answered (the flood is token-less; the gate must keep the trainer's
    door open). A failure is a violation whatever its type."""
    windows = [(s, e + FLOOD_GRACE_S) for s, e in result.flood_windows]
    for i, recs in sorted(records.items()):
        for r in recs:
            if r["ev"] not in ("exec", "exec_error"):
                continue
            if not any(s <= r["t"] <= e for s, e in windows):
                continue
            if r["ev"] == "exec":
                result.flood_calls["answered"] += 1
            else:
                result.flood_calls[r.get("kind", "?")] += 1
                result.violations["execd_flood_call_failures"] += 1
                result.details.append(f"trainer {i} #{r['n']}: exec {r.get('kind')} in a flood")


# -- the run ---------------------------------------------------------------------------------


def run(cfg: Config, progress: Callable[[str], None] = lambda s: None) -> Result:
    from bench.harness.faultproxy import Rule
    from broker.ledger.db import make_engine, make_session_factory
    from broker.ownership.audit import run_audit
    from broker.ownership.gc import run_gc
    from broker.ownership.provider import Provider

    rng = random.Random(cfg.seed)
    result = Result()
    t0 = time.monotonic()
    stack = Stack(cfg)
    world = make_world(cfg, stack)
    kinds = tuple(k for k in cfg.kinds if world.kinds_allowed is None or k in world.kinds_allowed)
    engine = None
    try:
        progress(f"starting services ({cfg.backend} backend)")
        stack.start_services()
        engine = make_engine(stack.database_url, pool_size=2)
        sessions = make_session_factory(engine)
        world.setup(sessions)
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
                    sentinel_lost.update(world.lost_sentinels())

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        end = time.monotonic() + cfg.duration_s
        order: list[str] = []
        while time.monotonic() < end:
            time.sleep(rng.uniform(*cfg.fault_gap_s))
            if time.monotonic() >= end:
                break
            if not order:  # every kind once per round, in a random order
                order = rng.sample(list(kinds), len(kinds))
            kind = order.pop()
            progress(f"fault {kind}")
            inject(kind, stack, world, rng, Rule, result)
            result.faults[kind] += 1
        if world.proxy is not None:
            world.proxy.clear()
            result.proxy_faults = dict(world.proxy.counts)

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
        check_flood_calls(read_records(cfg.state_dir), result)

        progress("recovery: waiting for queues and leases")
        _recover(stack, sessions, cfg)
        stack.stop_all()
        progress("one GC pass")
        provider = Provider(stack.settings, sessions, world.backend(), actor="gc")
        report = run_gc(provider)
        result.gc_pass_s = report.duration_s
        after = run_gc(provider, dry_run=True)
        result.violations["gc_actions_pending"] = len(after.actions)
        result.details += [f"pending after GC: {a}" for a in after.actions]
        _final_ownership(stack, world.running(), sessions, result)
        _final_audit(provider, world.running, world.sentinels, result, run_audit)
        leaks = scan_secrets(stack, sessions)
        result.violations["secrets_in_logs_or_ledger"] = len(leaks)
        result.details += leaks
        sentinel_lost.update(world.lost_sentinels())
        result.violations["hung_acquires"] = len(seen["hung"])
        result.violations["untyped_errors"] = len(seen["untyped"])
        result.violations["duplicate_handouts"] = len(seen["dup"])
        result.violations["sentinels_deleted"] = len(sentinel_lost)
        for k in ("hung", "untyped", "dup"):
            result.details += sorted(seen[k])
        result.details += [f"sentinel deleted: {n}" for n in sorted(sentinel_lost)]
    finally:
        stack.stop_all()
        world.teardown()
        if engine is not None:
            engine.dispose()
        stack.stop_services()
    result.duration_s = time.monotonic() - t0
    return result


def _final_audit(
    provider: Any,
    running: Callable[[], set[str]],
    sentinels: set[str],
    result: Result,
    run_audit: Any,
) -> None:
    """``sandman audit`` after the last GC pass, against the world's own count: they must
    agree, and the audit must be OK (no unowned or late pods, no dangling rows) but for
    the sentinels the world planted on purpose, which the audit must report and the GC
    must leave alone."""
    audit = run_audit(provider)
    result.audit_pods = sum(audit.pods_by_job.values())
    independent = running()
    result.independent_pods = len(independent)
    unexpected = set(audit.gc.unowned_pods) - sentinels
    if unexpected or audit.gc.late_pods or audit.gc.dangling_rows:
        result.violations["audit_not_ok"] += 1
        result.details.append(f"audit NOT OK: {audit.to_dict()}")
    if result.audit_pods != result.independent_pods:
        result.violations["audit_vs_independent_count"] += 1
        result.details.append(
            f"audit counts {result.audit_pods} pods, the world shows {sorted(independent)}"
        )


def inject(
    kind: str, stack: Stack, world: Any, rng: random.Random, rule: Any, result: Result
) -> None:
    proxy = world.proxy
    if kind == "kill_worker":
        name = rng.choice(["worker-acquire", "worker-control"])
        stack.kill(name)
        time.sleep(rng.uniform(1, 3))
        stack.spawn(name)
        # The next fault waits until this worker serves again: on a loaded machine a
        # restart takes long enough that back-to-back kills would only measure an outage.
        stack.wait_ready(name)
    elif kind == "crash_at_failpoint":
        points = stack.cfg.failpoints or world.points
        point = points[result.faults[kind] % len(points)]  # each point in turn
        name = "worker-control" if point in RELEASE_POINTS else "worker-acquire"
        stack.kill(name)
        stack.spawn(name, {"SANDMAN_FAILPOINT": point})
        proc = stack.procs[name]
        with contextlib.suppress(TimeoutError):  # no traffic reached the point: say so
            wait_for(lambda: proc.poll() is not None, 120, f"{name} to reach {point}")
        reached = proc.poll() == failpoints.EXIT_CODE
        result.failpoint_crashes[point if reached else f"{point} (not reached)"] += 1
        stack.kill(name)
        stack.spawn(name)
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
    elif kind == "flood_execd":
        from bench.harness.execdflood import flood

        start = time.time()
        result.flood_stats.update(flood(world.execd_ports, rng.uniform(8, 15)))
        result.flood_windows.append((start, time.time()))
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


def _final_ownership(stack: Stack, running: set[str], sessions: Any, result: Result) -> None:
    """Every sandbox the world shows (``running``: its own count, not the backend's) has
    exactly one live row, and every live row has a sandbox."""
    from sqlalchemy import func, select

    from broker.ledger.models import Event, Sandbox

    with sessions() as s:
        rows = s.execute(
            select(Sandbox.pod_name).where(
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
    by_name = Counter(name for (name,) in rows)
    for name in sorted(running):
        if name.startswith("sentinel-"):
            continue  # not ours by nonce: counted by the sentinel invariant
        if by_name.get(name, 0) != 1:
            result.violations["pods_without_one_live_row"] += 1
            result.details.append(f"pod {name} has {by_name.get(name, 0)} live rows")
    for name in sorted(by_name):
        if name not in running:
            result.violations["live_rows_without_pod"] += 1
            result.details.append(f"live row {name} has no pod")


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        out, url, timeout, seed, stop_path, image = sys.argv[2:8]
        trainer_main(out, url, float(timeout), int(seed), stop_path, image)
