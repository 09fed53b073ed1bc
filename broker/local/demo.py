"""``sandman demo``: the whole path on one machine, measured, and left clean.

Synthetic rollouts (acquire, a dozen commands and file edits, release) run against the
real stack: embedded PostgreSQL and Redis, Celery workers and beat, sandboxes as local
bubblewrap processes rooted in the task base image. Then the SWE demo task is graded in
its own image (the reference patch must resolve it, the empty patch must not). The
summary's "leaks" is what a GC pass and the ledger still find after everything was
released: it must be 0.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from sqlalchemy import func, select

from broker.errors import InfrastructureError, SandmanError
from broker.names import Queue, Task
from broker.settings import Settings

if TYPE_CHECKING:
    from broker.acquire.root import Root

SWE_TASK = Path(__file__).resolve().parents[2] / "deploy" / "images" / "swe-task" / "task.json"
DEMO_JOB = "demo"
DEMO_IMAGE = "localhost/sandman-task-base:v1"  # built by deploy/images/build.sh (make demo)
CPU, MEMORY = "500m", "512Mi"


@dataclass
class Tally:
    acquire_s: list[float] = field(default_factory=list)
    warm_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    warm: int = 0
    masked: int = 0
    failed_steps: int = 0
    errors: list[str] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rollout(client: Any, commands: int, tally: Tally, job: str = DEMO_JOB) -> None:
    """One synthetic rollout: a file, edits, reads and commands that check each other.

    Its marker file makes a shared sandbox visible at once: a rollout that finds any
    other rollout's marker in its workspace has observed state it did not make.
    """
    path, version = "/workspace/task.py", 0
    marker = f"/workspace/.rollout-{uuid.uuid4().hex}"
    try:
        with client.acquire(image=DEMO_IMAGE, cpu=CPU, memory=MEMORY, job=job, timeout=90) as sb:
            tally.acquire_s.append(sb.acquire_s)
            tally.warm += int(sb.lease.warm)
            (tally.warm_s if sb.lease.warm else tally.cold_s).append(sb.acquire_s)
            sb.write_file(marker, "")
            sb.write_file(path, "def answer():\n    return 0\n")
            for step in range(commands):
                started = time.perf_counter()
                if step % 3 == 1:
                    sb.edit(path, f"return {version}", f"return {version + 1}")
                    version += 1
                    ok = True
                elif step % 3 == 2:
                    ok = f"return {version}".encode() in sb.read_file(path)
                else:
                    res = sb.exec("python3 -B -c 'import task; print(task.answer())'", timeout=30)
                    ok = res.exit_code == 0 and res.stdout.strip() == str(version)
                tally.exec_s.append(time.perf_counter() - started)
                tally.failed_steps += int(not ok)
            markers = sb.exec("ls -a /workspace | grep '^.rollout-'", timeout=30).stdout.split()
            if markers != [marker.rsplit("/", 1)[1]]:
                tally.failed_steps += 1
                tally.errors.append(f"shared workspace: markers {markers}")
    except InfrastructureError:
        tally.masked += 1
    except SandmanError as exc:
        tally.failed_steps += 1
        tally.errors.append(f"{type(exc).__name__}: {exc}")


def run_demo(
    settings: Settings,
    *,
    rollouts: int,
    concurrency: int,
    warm: int,
    commands: int,
    echo: Callable[[str], None],
) -> bool:
    from broker.acquire.root import TOOL, Root
    from broker.client.sync import SandboxClient
    from broker.ledger import store
    from broker.local.stack import Stack, running_stack
    from broker.pools.store import pool_key
    from broker.wire.validation import parse_cpu, parse_memory

    stack = None
    t_start = time.monotonic()
    if running_stack(settings):
        echo("reusing the running stack")
        from broker.local.services import ensure_services

        urls = ensure_services(settings)
        database_url, redis_url = urls.database_url, urls.redis_url
    else:
        echo("starting PostgreSQL, Redis, workers and beat ...")
        stack = Stack(settings)
        stack.start(echo=True)
        database_url, redis_url = stack.database_url, stack.redis_url
    client = SandboxClient(redis_url, owner="demo")
    root = Root(settings, TOOL, database_url=database_url, redis=client.redis, actor="demo")
    warm_store = root.warm()
    assert warm_store is not None  # the stack's Redis answered the client just now
    key = pool_key(DEMO_IMAGE, None, None, parse_cpu(CPU), parse_memory(MEMORY))
    pools = (
        [
            {
                "image": DEMO_IMAGE,
                "cpu_m": parse_cpu(CPU),
                "memory_b": parse_memory(MEMORY),
                "size": warm,
                "idle_timeout_s": 300,
            }
        ]
        if warm
        else []
    )
    try:
        with root.sessions.begin() as session:
            store.ensure_job(session, DEMO_JOB, warm_pools=pools, lease_s=120.0)
        if warm:
            client.send(Task.POOL_UPKEEP, [], Queue.POOL)
            deadline = time.monotonic() + 30
            while warm_store.size(DEMO_JOB, key) < warm:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            echo(f"warm pool: {warm_store.size(DEMO_JOB, key)}/{warm} ready")
        tally = Tally()
        t0 = time.monotonic()
        with (
            click.progressbar(length=rollouts, label="rollouts") as bar,
            ThreadPoolExecutor(concurrency) as pool,
        ):
            futures = [pool.submit(rollout, client, commands, tally) for _ in range(rollouts)]
            for fut in futures:
                fut.result()
                bar.update(1)
        wall = time.monotonic() - t0
        graded = _grade_swe_task(client, echo)
        leaks = _settle(root, client, echo)
        ok = leaks == 0 and tally.masked == 0 and tally.failed_steps == 0 and graded
        n = len(tally.acquire_s)
        echo("")
        echo(f"acquisitions     {n}/{rollouts}  (masked infra failures: {tally.masked})")
        echo(
            f"acquire p50/p99  {pct(tally.acquire_s, 50) * 1000:.1f} ms / "
            f"{pct(tally.acquire_s, 99) * 1000:.1f} ms"
        )
        echo(
            f"exec p50/p99     {pct(tally.exec_s, 50) * 1000:.1f} ms / "
            f"{pct(tally.exec_s, 99) * 1000:.1f} ms  ({len(tally.exec_s)} calls, "
            f"{tally.failed_steps} failed)"
        )
        echo(
            f"warm-hit rate    {tally.warm / max(n, 1):.0%}  (warm p50 "
            f"{pct(tally.warm_s, 50) * 1000:.1f} ms, "
            f"cold p50 {pct(tally.cold_s, 50) * 1000:.0f} ms)"
        )
        echo(f"throughput       {n / wall:.1f} rollouts/s over {wall:.1f} s")
        echo(f"leaks            {leaks}")
        echo(f"total            {time.monotonic() - t_start:.1f} s  -> {'OK' if ok else 'FAILED'}")
        for error in tally.errors[:3]:
            echo(f"error: {error}")
        if tally.acquire_s:
            echo(f"(mean acquire {statistics.mean(tally.acquire_s) * 1000:.1f} ms)")
        return ok
    finally:
        client.close()
        root.dispose()
        if stack is not None:
            stack.stop()


def _grade_swe_task(client: Any, echo: Callable[[str], None]) -> bool:
    """Grade the SWE demo task in its image (localhost/sandman-swe-task:v1): the reference
    patch resolves it, the empty patch does not. Skipped (True) outside a source checkout."""
    from broker.grading import GradeConfig, GradingClient, Verdict, load_task

    if not SWE_TASK.exists():
        echo("grading          skipped (no deploy/images/swe-task in this install)")
        return True
    task = load_task(SWE_TASK)
    config = GradeConfig(max_attempts=2, cpu=0.5, memory="512Mi", acquire_timeout_s=90)
    grader = GradingClient(client, job=DEMO_JOB, config=config)
    started = time.monotonic()
    reference = grader.grade(task, task.reference_patch)
    empty = grader.grade(task, b"")
    ok = reference.verdict is Verdict.RESOLVED and empty.verdict is Verdict.UNRESOLVED
    echo(
        f"grading          {task.image}: reference {reference.verdict.value}, empty patch "
        f"{empty.verdict.value} ({time.monotonic() - started:.1f} s)"
        + ("" if ok else f"  {reference.reason or empty.reason}")
    )
    return ok


def _settle(root: Root, client: Any, echo: Callable[[str], None]) -> int:
    """Drain the warm pool, wait for every release, then count what a GC pass finds."""
    from broker.ledger import store
    from broker.ledger.models import Sandbox
    from broker.ledger.states import State

    sessions = root.sessions
    with sessions.begin() as session:
        store.ensure_job(session, DEMO_JOB, warm_pools=[])
    client.send(Task.POOL_UPKEEP, [], Queue.POOL)
    live = (State.REQUESTED, State.CREATING, State.READY, State.RELEASING, State.ABANDONED)
    deadline = time.monotonic() + 60
    remaining = -1
    while time.monotonic() < deadline:
        with sessions() as session:
            remaining = (
                session.scalar(
                    select(func.count())
                    .select_from(Sandbox)
                    .where(Sandbox.job == DEMO_JOB, Sandbox.state.in_(live))
                )
                or 0
            )
        if remaining == 0:
            break
        client.send(Task.POOL_UPKEEP, [], Queue.POOL)
        time.sleep(1.0)
    try:
        report = root.gc.run(actor=root.actor)
    except SandmanError as exc:
        echo(f"GC pass failed: {exc}")
        return remaining + 1
    return remaining + len(report.unowned_pods) + len(report.dangling_rows)
