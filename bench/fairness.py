"""Fair share of the create rate (issue 19, item 2): a bursting job against a steady one,
and two jobs of weights 1 and 3, through the whole stack.

    env SANDMAN_STATE_DIR=/some/own/dir .venv/bin/python bench/fairness.py \\
        [--rate 4] [--burst 4] [--burst-size 10000] [--b-seconds 40]
    .venv/bin/python bench/fairness.py --backend kube --rate 25 --burst 25

One run, three phases on one stack, on either backend:

* ``local`` (the default): ``sandman up``'s workers on ``SANDMAN_STATE_DIR``, real
  bubblewrap sandboxes;
* ``kube``: the kwok-stack harness of the scale run (``bench/kube_stack.py``: its own
  state dir, ports, installation id and namespace; every job pinned to the kwok nodes,
  **readiness simulated**), ending with the release of everything and the leak check
  (pods left, open leaks, live rows: all must be 0).

The phases, paced at ``--rate`` creates/s (burst ``--burst``):

1. **B alone** (after one warm-up acquire): job B asks for one sandbox per second (each
   ask in its own thread, so a slow one does not delay the next), ``--alone-seconds``
   long. This is the baseline.
2. **B while A bursts**: job A enqueues ``--burst-size`` acquires at once (the trainer
   client's batch), then B asks one per second again for ``--b-seconds``. A's sandboxes are
   released as soon as they are handed out (a reaper reads the ledger), so the run stays
   small; at the end every A request still queued is cancelled (the trainer gives up).
3. **Weights 1 and 3**: jobs C (weight 1) and D (weight 3) enqueue ``--weighted`` each;
   the share of each in the first ``--count`` creates (ledger order, ``creating_at``) while
   both are backlogged, against the 25% / 75% target; the rest is cancelled.

Prints B's acquire latency (client-measured, queue-inclusive) p50/p90/p99 alone and with
A bursting, their ratio, where B's time went (ledger: fair queue and gate, pacer, create),
the CPU of the broker (and of the API server) in each phase, A's creates during phase 2,
and the weighted shares. On kube, beside each of B's asks, a bare pod is created and
watched to Ready with no broker at all (the cluster's own latency under the same load).
Saves bench/out/fairness.json (``fairness-kube.json`` on kube).
A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import save, stop_services, summary
from bench.kube_stack import stack_arguments
from bench.meter import Meter

IMAGE = "localhost/sandman-task-base:v1"


@dataclass
class Rig:
    """What the phases need of a running stack, whichever its backend."""

    backend: str
    sessions: Any
    client: Any
    shape: dict[str, Any]  # image, cpu, memory of every acquire
    new_job: Callable[[Any, str], object]  # (session, job): the job, on this backend's nodes
    groups: dict[str, list[int]]  # process groups whose CPU each phase reports
    finish: Callable[[dict[str, Any], set[str]], None]  # the end of a run: leak check
    probe: Callable[[], float] | None = None  # the cluster's POST -> Ready, no broker


@contextlib.contextmanager
def local_rig(args: argparse.Namespace) -> Iterator[Rig]:
    """``sandman up``'s stack on ``SANDMAN_STATE_DIR``, the local backend."""
    os.environ["SANDMAN_CREATE_RATE"] = str(args.rate)
    os.environ["SANDMAN_CREATE_BURST"] = str(args.burst)
    os.environ.setdefault("SANDMAN_LOG_LEVEL", "WARNING")
    from broker.client.sync import SandboxClient
    from broker.ledger import store
    from broker.ledger.db import make_engine, make_session_factory
    from broker.local.stack import Stack, running_stack
    from broker.settings import Settings

    settings = Settings.from_env()
    if running_stack(settings):
        raise SystemExit("a `sandman up` is running on this state dir; stop it first")
    stack = Stack(settings)
    print("starting the stack ...", flush=True)
    stack.start(web=False, echo=False)
    client = SandboxClient(stack.redis_url, owner="bench-fairness", heartbeat_s=3600)
    try:
        yield Rig(
            backend=settings.backend,
            sessions=make_session_factory(make_engine(stack.database_url)),
            client=client,
            shape={"image": IMAGE, "cpu": "100m", "memory": "64Mi"},
            new_job=lambda session, job: store.ensure_job(session, job, lease_s=3600.0),
            groups={"broker": [p.pid for p in stack.procs.values()]},
            finish=lambda doc, jobs: None,
        )
    finally:
        client.close()
        stack.stop(echo=lambda _: None)
        stop_services(settings)  # the stack leaves the embedded services running


@contextlib.contextmanager
def kube_rig(args: argparse.Namespace) -> Iterator[Rig]:
    """The scale run's harness on the kwok nodes (simulated readiness), leak-checked."""
    from bench.cold_kwok import bare_create_to_ready
    from bench.kube_stack import CPU, MEMORY, Harness
    from bench.kwok import ensure_kwok_job

    tag = f"fair-{dt.datetime.now(dt.UTC):%m%d%H%M}"
    print(f"starting the stack {tag} (kwok nodes) ...", flush=True)
    probes = itertools.count()
    with Harness(args, tag) as h:
        yield Rig(
            backend="kubernetes (kwok nodes, readiness simulated)",
            sessions=h.sessions,
            client=h.client,
            shape={"image": IMAGE, "cpu": CPU, "memory": MEMORY},
            new_job=lambda session, job: ensure_kwok_job(session, job, lease_s=3600.0),
            groups=h.meter.groups,
            finish=lambda doc, jobs: h.release_and_check([], doc, jobs),
            probe=lambda: bare_create_to_ready(h, 1, 1, f"{tag}-{next(probes)}")[0],
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("local", "kube"), default="local")
    parser.add_argument("--burst-size", type=int, default=10_000)
    parser.add_argument("--alone-seconds", type=int, default=30)
    parser.add_argument("--b-seconds", type=int, default=40)
    parser.add_argument("--weighted", type=int, default=400, help="acquires per weighted job")
    parser.add_argument("--count", type=int, default=200, help="creates counted for shares")
    # --rate and --burst pace both backends; the other flags are the kube harness's
    stack_arguments(parser, rate=4.0, burst=4, waiters=1, release_timeout=900)
    args = parser.parse_args()
    rig = kube_rig(args) if args.backend == "kube" else local_rig(args)
    with rig as r:
        return run(r, args)


def run(rig: Rig, args: argparse.Namespace) -> int:
    from broker.acquire import weights
    from broker.client import core

    sessions, client, shape = rig.sessions, rig.client, rig.shape
    tag = secrets.token_hex(2)
    a, b, c, d = (f"fair-{x}-{tag}" for x in "abcd")
    with sessions.begin() as session:
        for job in (a, b, c, d):
            rig.new_job(session, job)
    weights.set_job_weight(sessions, d, 3, actor="bench", redis=client.redis)
    reaper = Reaper(sessions, client, {a, c, d})
    reaper.start()
    doc: dict[str, Any] = {"rate": args.rate, "burst": args.burst, "backend": rig.backend}
    try:
        client.open(job=b, timeout=600, **shape).release()  # warm-up: image unpacked, etc.
        print(f"phase 1: B alone, 1 ask/s for {args.alone_seconds} s", flush=True)
        t_alone, meter = time.time(), Meter(rig.groups)
        alone, bare_alone = steady(client, b, args.alone_seconds, shape, rig.probe)
        usage_alone = cores(meter)
        t_burst, meter = time.time(), Meter(rig.groups)
        print(f"phase 2: A enqueues {args.burst_size}, B asks 1/s for {args.b_seconds} s")
        burst = core.group_requests(args.burst_size, client.owner, job=a, timeout=3600, **shape)
        t0 = time.perf_counter()
        client.enqueuer.send_all(core.acquire_message(r) for r in burst)
        enqueue_s = time.perf_counter() - t0
        a_before = creates_of(sessions, a)
        contended, bare_burst = steady(client, b, args.b_seconds, shape, rig.probe)
        a_during = creates_of(sessions, a) - a_before
        usage_burst = cores(meter)
        parts_alone = breakdown(sessions, b, t_alone, t_burst)
        parts_burst = breakdown(sessions, b, t_burst, time.time())
        cancel(client, burst)
        wait_drained(client)
        print(f"phase 3: weights 1 and 3, {args.weighted} acquires each", flush=True)
        mixed = [
            *core.group_requests(args.weighted, client.owner, job=c, timeout=3600, **shape),
            *core.group_requests(args.weighted, client.owner, job=d, timeout=3600, **shape),
        ]
        client.enqueuer.send_all(core.acquire_message(r) for r in mixed)
        order = first_creates(sessions, {c, d}, args.count)
        cancel(client, mixed)
        wait_drained(client)
        share_c, share_d = order.count(c) / len(order), order.count(d) / len(order)
        prefix_err = max(abs(order[:k].count(d) / k - 0.75) for k in range(40, len(order) + 1, 20))
        doc.update(
            b_alone=summary(alone),
            b_with_a_burst=summary(contended),
            p50_ratio=summary(contended)["p50"] / summary(alone)["p50"],
            p99_ratio=summary(contended)["p99"] / summary(alone)["p99"],
            a_burst=args.burst_size,
            a_enqueue_s=enqueue_s,
            a_creates_during=a_during,
            b_creates_during=len(contended),
            weighted={"count": len(order), "share_w1": share_c, "share_w3": share_d},
            weighted_worst_prefix_error=prefix_err,
            b_parts_alone=parts_alone,
            b_parts_with_a_burst=parts_burst,
            cores_alone=usage_alone,
            cores_with_a_burst=usage_burst,
            bare_alone=summary(bare_alone),
            bare_with_a_burst=summary(bare_burst),
        )
        report(doc, alone, contended, args)
        name = "fairness" if args.backend == "local" else f"fairness-{args.backend}"
        save(name, doc)  # the figures survive a teardown that fails
        rig.finish(doc, {a, b, c, d})
        save(name, doc)
    finally:
        reaper.stop()
    return 0


def cores(meter: Meter) -> dict[str, float]:
    """Average cores of each process group since ``meter`` started, and the load average."""
    out = {name: round(t["avg_cores"], 2) for name, t in meter.totals().items()}
    out["load1"] = round(os.getloadavg()[0], 1)
    return out


def report(doc: dict[str, Any], alone: list[float], contended: list[float], args: Any) -> None:
    print()
    for name, series in (("B alone", alone), ("B, A bursting", contended)):
        s = summary(series)
        print(
            f"{name:16} acquire p50 {s['p50']:.3f}s  p90 {s['p90']:.3f}s  "
            f"p99 {s['p99']:.3f}s  (n={s['n']})"
        )
    for name, key in (("B alone", "b_parts_alone"), ("B, A bursting", "b_parts_with_a_burst")):
        print(
            f"{name:16} "
            + "  ".join(f"{k} p50 {v['p50']:.3f}s p99 {v['p99']:.3f}s" for k, v in doc[key].items())
        )
    for name, key in (("bare alone", "bare_alone"), ("bare, A bursting", "bare_with_a_burst")):
        if doc[key]["n"]:
            b = doc[key]
            print(
                f"{name:16} POST->Ready p50 {b['p50']:.3f}s  p90 {b['p90']:.3f}s  "
                f"p99 {b['p99']:.3f}s  (n={b['n']}; the cluster alone, one pod a second)"
            )
    for name, key in (("B alone", "cores_alone"), ("B, A bursting", "cores_with_a_burst")):
        print(f"{name:16} cores: " + "  ".join(f"{k} {v}" for k, v in doc[key].items()))
    print(f"ratio (A bursting / alone): p50 {doc['p50_ratio']:.2f}x  p99 {doc['p99_ratio']:.2f}x")
    print(
        f"A: {args.burst_size} enqueued in {doc['a_enqueue_s']:.2f}s; "
        f"{doc['a_creates_during']} of its creates during B's {args.b_seconds} s "
        f"(B: {doc['b_creates_during']})"
    )
    w = doc["weighted"]
    print(
        f"weights 1 and 3: shares {w['share_w1']:.1%} / {w['share_w3']:.1%} of the first "
        f"{w['count']} creates (target 25% / 75%); worst prefix (40+) off by "
        f"{doc['weighted_worst_prefix_error']:.1%}",
        flush=True,
    )


def steady(
    client: Any,
    job: str,
    seconds: int,
    shape: dict[str, Any],
    probe: Callable[[], float] | None = None,
) -> tuple[list[float], list[float]]:
    """One acquire per second for ``seconds``, each in its own thread: their latencies;
    and beside each acquire one ``probe`` (the cluster's own POST -> Ready, no broker):
    its latencies, under the same load."""
    out: list[float] = []
    bare: list[float] = []
    lock = threading.Lock()

    def ask() -> None:
        sandbox = client.open(job=job, timeout=600, **shape)
        with lock:
            out.append(sandbox.acquire_s)
        sandbox.release()

    def sample() -> None:
        assert probe is not None
        try:
            took = probe()
        except Exception as exc:  # a probe that fails is no latency; the run goes on
            print(f"bare probe failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            return
        with lock:
            bare.append(took)

    threads = []
    start = time.monotonic()
    for i in range(seconds):
        time.sleep(max(0.0, start + i - time.monotonic()))
        for target in (ask, sample) if probe else (ask,):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    return out, bare


def breakdown(sessions: Any, job: str, since: float, until: float) -> dict[str, Any]:
    """Where B's acquires spent their time, from the ledger: enqueue -> admitted (the fair
    queue and the gate), admitted -> creating (the pacer's token), creating -> ready."""
    from sqlalchemy import select

    from broker.ledger.models import Sandbox

    lo, hi = (dt.datetime.fromtimestamp(t, dt.UTC) for t in (since, until))
    with sessions() as session:
        rows = session.execute(
            select(Sandbox.enqueued_at, Sandbox.requested_at, Sandbox.creating_at, Sandbox.ready_at)
            .where(Sandbox.job == job, Sandbox.enqueued_at >= lo, Sandbox.enqueued_at < hi)
            .where(Sandbox.ready_at.is_not(None))
        ).all()
    parts = {
        "queue": [(r.requested_at - r.enqueued_at).total_seconds() for r in rows],
        "pacer": [(r.creating_at - r.requested_at).total_seconds() for r in rows],
        "create": [(r.ready_at - r.creating_at).total_seconds() for r in rows],
    }
    return {name: summary(values) for name, values in parts.items()}


def creates_of(sessions: Any, job: str) -> int:
    from sqlalchemy import func, select

    from broker.ledger.models import Sandbox

    with sessions() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Sandbox)
                .where(Sandbox.job == job, Sandbox.creating_at.is_not(None))
            )
            or 0
        )


def first_creates(sessions: Any, jobs: set[str], count: int) -> list[str]:
    """The jobs of the first ``count`` creates among ``jobs``, in create order (waits)."""
    from sqlalchemy import select

    from broker.ledger.models import Sandbox

    while True:
        with sessions() as session:
            rows = session.execute(
                select(Sandbox.job)
                .where(Sandbox.job.in_(jobs), Sandbox.creating_at.is_not(None))
                .order_by(Sandbox.creating_at, Sandbox.id)
                .limit(count)
            ).all()
        if len(rows) >= count:
            return [job for (job,) in rows]
        time.sleep(1.0)


def cancel(client: Any, requests: list[dict[str, Any]]) -> None:
    """What trainers that stop waiting do: set each request's cancel flag (pipelined)."""
    from broker.wire import mailbox

    script = client.redis.register_script(mailbox.CANCEL_LUA)
    pipe = client.redis.pipeline(transaction=False)
    for request in requests:
        keys, args = mailbox.cancel_call(request["request_id"])
        script(keys=keys, args=args, client=pipe)
    pipe.execute()


def wait_drained(client: Any) -> None:
    """Until no acquire is queued or served (cancelled ones are dropped by the pops), and
    no "acquire pending" message is left: a run that ended with thousands of them would
    leave them to the next run's workers (its Redis keeps them on disk)."""
    from broker.acquire.fairshare import PROC
    from broker.names import Queue
    from broker.wire import fairq

    r = client.redis
    while r.hlen(fairq.BODIES) or r.zcard(PROC) or r.llen(Queue.ACQUIRE.value):
        time.sleep(0.5)


class Reaper(threading.Thread):
    """Releases the sandboxes of the bursting jobs as soon as they are handed out."""

    def __init__(self, sessions: Any, client: Any, jobs: set[str]) -> None:
        super().__init__(name="reaper", daemon=True)
        self.sessions, self.client, self.jobs = sessions, client, jobs
        self.stopped = threading.Event()
        self.released: set[str] = set()

    def run(self) -> None:
        from sqlalchemy import select

        from broker.client import core
        from broker.ledger.models import Sandbox
        from broker.ledger.states import State

        while not self.stopped.wait(0.5):
            with self.sessions() as session:
                ids = session.scalars(
                    select(Sandbox.id).where(
                        Sandbox.job.in_(self.jobs), Sandbox.state == State.READY
                    )
                ).all()
            fresh = [sid for sid in ids if sid not in self.released]
            if fresh:
                self.client.enqueuer.send_all(core.release_message(sid) for sid in fresh)
                self.released.update(fresh)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
