"""Check the simulator against the real broker: drive a running stack with a trace.

Each trace event becomes a trainer thread that acquires at its (compressed) time through
the real client, holds the sandbox for its (compressed) duration and releases it. The
measured warm-hit rate and creates are then compared with ``simulate`` on the same
compressed trace, with ``create_s`` set to the create-to-ready the run itself measured.
Used by ``bench/report.py``; the local backend is enough (it exercises the same pool code).
"""

from __future__ import annotations

import datetime as dt
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.names import Queue, Task
from broker.pools.store import WarmStore, pool_key
from broker.replay.sim import Policy, percentile, simulate
from broker.replay.trace import TraceEvent

CPU_M, MEMORY_B = 100, 64 << 20


def synthetic_trace(
    n: int = 60, span_s: float = 120.0, seed: int = 7, images: tuple[str, ...] = ()
) -> list[TraceEvent]:
    """Bursty requests over a few images with a skewed popularity (like the paper's 80%
    of an image's requests within 10 s of another)."""
    rng = random.Random(seed)
    names = images or ("replay/img-a:1", "replay/img-b:1", "replay/img-c:1")
    weights = [0.6, 0.3, 0.1][: len(names)]
    events: list[TraceEvent] = []
    t = 0.0
    while len(events) < n:
        t += rng.expovariate(n / span_s) * (4 if rng.random() < 0.15 else 1)
        burst = 1 + (rng.random() < 0.2) * rng.randint(1, 3)
        for _ in range(burst):
            image = rng.choices(names, weights)[0]
            events.append(TraceEvent(t, "replay", image, "rollout", rng.uniform(2.0, 10.0)))
    return events[:n]


@dataclass
class Measured:
    requests: int = 0
    hits: int = 0
    errors: list[str] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    creates: int = 0
    create_to_ready: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "hits": self.hits,
            "hit_rate": self.hits / self.requests if self.requests else float("nan"),
            "creates": self.creates,
            "wait_p50_s": percentile(self.waits, 50),
            "wait_p90_s": percentile(self.waits, 90),
            "wait_p99_s": percentile(self.waits, 99),
            "wait_mean_s": statistics.fmean(self.waits) if self.waits else float("nan"),
            "create_to_ready_p50_s": percentile(self.create_to_ready, 50),
            "errors": self.errors[:5],
        }


def drive(
    client: Any,
    sessions: sessionmaker[Session],
    events: list[TraceEvent],
    *,
    job: str,
    policy: Policy,
    speed: float = 1.0,
    fill_timeout_s: float = 180.0,
    log: Any = print,
) -> dict[str, Any]:
    """Configure ``job``'s pools from ``policy``, wait until full, replay, compare."""
    pools = [
        {
            "image": image,
            "cpu_m": CPU_M,
            "memory_b": MEMORY_B,
            "size": size,
            "idle_timeout_s": policy.idle_timeout_s,
        }
        for image, size in sorted(policy.warm.items())
    ]
    with sessions.begin() as session:
        store.ensure_job(session, job, warm_pools=pools)
    warm = WarmStore(client.redis)
    keys = {img: pool_key(img, None, None, CPU_M, MEMORY_B) for img in policy.warm}
    client.send(Task.POOL_UPKEEP, [], Queue.POOL)
    deadline = time.monotonic() + fill_timeout_s
    while any(warm.size(job, keys[i]) < n for i, n in policy.warm.items()):
        if time.monotonic() > deadline:
            raise TimeoutError("warm pools did not fill")
        time.sleep(0.2)
    started = dt.datetime.now(dt.UTC)
    log(f"pools full ({sum(policy.warm.values())} pods); replaying {len(events)} acquires")
    measured = Measured(requests=len(events))
    lock = threading.Lock()
    t0 = time.monotonic() + 0.5

    def trainer(event: TraceEvent) -> None:
        time.sleep(max(0.0, t0 + event.time / speed - time.monotonic()))
        try:
            sb = client.open(
                image=event.image, cpu=f"{CPU_M}m", memory=MEMORY_B, job=job, timeout=300
            )
        except Exception as exc:
            with lock:
                measured.errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            measured.hits += int(sb.lease.warm)
            measured.waits.append(sb.acquire_s)
        time.sleep(event.duration / speed)
        sb.release()

    threads = [threading.Thread(target=trainer, args=(e,), daemon=True) for e in events]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = dt.datetime.now(dt.UTC)
    time.sleep(2.0)
    with sessions() as session:
        rows = session.scalars(
            select(Sandbox).where(
                Sandbox.job == job,
                Sandbox.requested_at >= started,
                Sandbox.requested_at <= ended,
            )
        ).all()
        measured.creates = sum(1 for r in rows if r.creating_at is not None)
        measured.create_to_ready = [r.create_to_ready_s for r in rows if r.create_to_ready_s]
    # Trace time is compressed by ``speed``; the idle timeout is real seconds.
    compressed = [
        TraceEvent(e.time / speed, e.job, e.image, e.role, e.duration / speed) for e in events
    ]
    create_s = percentile(measured.create_to_ready, 50)
    hit_s = percentile([w for w in measured.waits if w < create_s / 2] or [0.05], 50)
    predicted = simulate(
        compressed,
        Policy(
            **{
                **policy.__dict__,
                "create_s": create_s,
                "hit_s": hit_s,
            }
        ),
    ).to_dict()
    with sessions.begin() as session:
        store.ensure_job(session, job, warm_pools=[])
    client.send(Task.POOL_UPKEEP, [], Queue.POOL)
    return {
        "job": job,
        "speed": speed,
        "policy": {**policy.__dict__, "create_s": create_s, "hit_s": hit_s},
        "measured": measured.to_dict(),
        "predicted": predicted,
    }
